"""The package's floors: cli > cli_parser > api | preflight > engine > model > graphs > config/metrics > settings > choices/vllm_metrics. Each module imports
only graphcache modules of lower floors (or of its own package); no function-level import dodges a
cycle; and the CPU-only scheduler floor pulls in no torch.

Inside the engine, the stages are floors too: loop > sched | worker > sample > the engine's base
modules (plan, sequence, errors, stopping). The scheduler and the worker are peers and import none of each
other: the step plan (plan.py, plain data) is all that crosses between them. The worker samples, so it
stands above sample/, which reaches into neither. No module imports another module's private (underscore)
name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import graphcache

PACKAGE = Path(graphcache.__file__).parent
FLOORS = {
    "__main__": 8,
    "cli": 7,
    "cli_parser": 6,  # serve's flags and the settings they give
    "api": 5,
    "preflight": 5,  # serve's startup checks (and StartupError, which cli_parser raises too)
    "engine": 4,
    "model": 3,
    "graphs": 2,
    "config": 1,
    "metrics": 1,
    "settings": 0,
    "vllm_flags": 0,  # cli's vLLM flags, above their table (vllm_flag_table, like every unlisted module: -1)
    "exit_watchdog": 0,  # cli's stop watchdog: imports nothing of the package
    "choices": -1,
    "vllm_metrics": -1,
}


def _floor(module: str) -> tuple[str, int]:
    """graphcache.engine.loop.core -> ("engine", 4)."""
    top = module.split(".")[1] if "." in module else "__init__"
    return top, FLOORS.get(top, -1)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported graphcache module, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("graphcache"):
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("graphcache")]
        found += [(n, id(node) in top_level) for n in names]
    return found


def test_no_module_imports_upward_and_no_import_dodges_a_cycle():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts)
        own, floor = _floor(module)
        if own == "__init__":
            continue
        for imported, at_top in _imports(path):
            their, their_floor = _floor(imported)
            if their != own and their_floor >= floor:
                bad.append(f"{module} imports {imported} (floor {their} is not below {own})")
            if not at_top and (their == own or their_floor >= floor):
                bad.append(f"{module} imports {imported} inside a function (dodging a cycle)")
    assert not bad, "\n".join(bad)


# anything else in engine/: the base, 0. sched and worker are peers (a rank below the other's is not
# enough: test_no_worker_module_imports_the_scheduler checks the worker's side).
ENGINE_STAGES = {"loop": 3, "sched": 1, "worker": 2, "sample": 1}


def _engine_stage(module: str) -> tuple[str, int] | None:
    """graphcache.engine.sched.scheduler -> ("sched", 1); graphcache.engine.plan -> ("base", 0)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "engine":
        return None
    return (parts[2], ENGINE_STAGES[parts[2]]) if parts[2] in ENGINE_STAGES else ("base", 0)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts), path


def test_engine_stages_import_only_lower_stages():
    bad = []
    for module, path in _modules():
        own = _engine_stage(module)
        if own is None or module.endswith("__init__"):
            continue
        for imported, _ in _imports(path):
            their = _engine_stage(imported)
            if their is None or their[0] == own[0]:
                continue
            if their[1] >= own[1]:
                bad.append(f"{module} imports {imported} (stage {their[0]} is not below {own[0]})")
    assert not bad, "\n".join(bad)


def test_no_worker_module_imports_the_scheduler():
    """The worker knows a step only as its StepPlan: nothing under engine/worker/ imports engine/sched/."""
    bad = [
        f"{module} imports {imported}"
        for module, path in _modules()
        if module.startswith("graphcache.engine.worker.")
        for imported, _ in _imports(path)
        if imported.startswith("graphcache.engine.sched")
    ]
    assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_name():
    bad = []
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("graphcache")
                and node.module != module
            ):
                bad += [
                    f"{module} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not bad, "\n".join(bad)


def test_scheduler_floor_imports_no_torch():
    code = (
        "import sys, graphcache.engine.sched.scheduler, graphcache.engine.sched.block_manager, graphcache.engine.plan; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "importing the scheduler pulled in torch"


# The model modules the API process needs, none of them importing torch: the tokenizer with its chat
# templates and streaming detokenizer, the model setting's classification (served name, CLI preflight)
# and the generation defaults it applies, and whether the model serves embeddings.
HTTP_FLOOR_MODEL_MODULES = {
    "graphcache.model.tokenizer",
    "graphcache.model.chat_template",
    "graphcache.model.detokenizer",
    "graphcache.model.source",
    "graphcache.model.generation_defaults",
    "graphcache.model.embedding_config",
}


def test_http_floor_imports_no_torch():
    """With the engine in its own process the API process only does HTTP, tokenizing and detokenizing:
    importing the app must load neither torch nor the model code."""
    code = (
        "import sys, graphcache.api.server.app, graphcache.cli; "
        "print('torch' in sys.modules, any(m.startswith('graphcache.model.') and m not in "
        f"{sorted(HTTP_FLOOR_MODEL_MODULES)!r} for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], (
        "importing the HTTP floor pulled in torch or the model code"
    )

"""docs/ARCHITECTURE.md's module map names every module of the package, and only modules that exist.

The map is the first fenced block of the file: a folder heading (`engine/`, then `loop/` indented under it)
opens a folder, and a `name.py` line below it at a deeper indent is a module of that folder. A line that
starts with several file names (`config.py  metrics.py`) maps each of them."""

from __future__ import annotations

import re
from pathlib import Path

import graphcache

PACKAGE = Path(graphcache.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"
ENTRY = re.compile(r"^(?P<indent> *)(?P<names>(?:[\w.]+(?:/|\.py)\s{1,2})*[\w.]+(?:/|\.py))(?=\s|$)")


def _package_modules() -> set[str]:
    """Every module file below the package, as a path relative to it (engine/loop/core.py)."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def _map_block() -> list[str]:
    """The lines of the first fenced block of docs/ARCHITECTURE.md: the module map."""
    text = ARCHITECTURE.read_text()
    start = text.index("```\n") + len("```\n")
    return text[start : text.index("```", start)].splitlines()


def _mapped_modules() -> set[str]:
    """The module paths the map names, each folder heading prefixed to the files indented under it."""
    folders: list[tuple[int, str]] = []  # (indent, "engine/loop/") from the outermost folder in
    found = set()
    for line in _map_block():
        match = ENTRY.match(line)
        if match is None:
            continue
        indent = len(match["indent"])
        while folders and folders[-1][0] >= indent:
            folders.pop()
        prefix = folders[-1][1] if folders else ""
        for name in match["names"].split():
            if name.endswith("/"):
                folders.append((indent, prefix + name))
            else:
                found.add(prefix + name)
    return found


def test_the_map_names_every_module():
    missing = sorted(_package_modules() - _mapped_modules())
    assert not missing, (
        f"docs/ARCHITECTURE.md's module map lacks {missing}: add one line per module under its folder heading, "
        "saying what it is for"
    )


def test_the_map_names_only_modules_that_exist():
    stale = sorted(_mapped_modules() - _package_modules())
    assert not stale, (
        f"docs/ARCHITECTURE.md's module map names {stale}, which are not in service/graphcache: "
        "drop them or write the path they moved to"
    )


def test_the_map_is_read_as_written():
    # The parser must see folders and their files, or both tests above would pass on an empty map.
    mapped = _mapped_modules()
    assert {"cli.py", "api/server/app.py", "engine/loop/core.py", "graphs/cache.py"} <= mapped

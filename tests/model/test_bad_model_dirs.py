"""Bad model directories are refused in one line, before anything is allocated (issue 35 item 7).

Each case is the embedded tiny model with one thing broken: config.json with sizes past any published
model, inconsistent or malformed; weights whose shapes differ from the ones config.json implies, a
missing tensor, a truncated or corrupt safetensors file. config.json's problems are found by serve's
preflight (exit 2, "graphcache: model '<dir>': <what>; <fix>"); the weights' by the loader from the
safetensors headers, before the model's memory is allocated (exit 3, "graphcache: the engine failed
to load the model: <what>; <fix>"). Before this, 1,000,000 layers were still "loading" after 120 s with
memory growing, and some of the rest ended in a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from graphcache.cli import StartupError, check_model_dir
from graphcache.model.config import (
    MAX_HEADS,
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_LAYERS,
    MAX_VOCAB_SIZE,
    ModelLoadError,
    read_config,
)
from graphcache.model.loader import load_model
from graphcache.model.tiny import make_default_model
from safetensors.torch import load_file, save_file

# A refusal by the preflight imports torch and reads config.json: about 5 s here; a busy 2-core CI
# machine may take several times that. Loading the 1,000,000-layer config ran for minutes.
REFUSED_WITHIN_S = 40
# A refused start holds what importing torch takes (about 0.4 GB); building 1,000,000 layers grew
# past several GB. The peak resident memory of the whole serve process is bounded.
REFUSED_PEAK_RSS_BYTES = 1500 * 2**20
# A load failure starts the engine (imports, tokenizer) before the loader refuses.
LOAD_FAILURE_WITHIN_S = 120
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_default_model(tmp_path_factory.mktemp("tiny") / "model")


def broken(
    tiny: Path,
    root: Path,
    config: dict | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A copy of the tiny model with config.json's keys changed (None: removed) and/or its tensors
    edited in place by `tensors`."""
    path = root / "bad"
    shutil.copytree(tiny, path)
    if config is not None:
        data = json.loads((path / "config.json").read_text())
        for key, value in config.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        (path / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        weights = load_file(path / WEIGHTS)
        tensors(weights)
        save_file(weights, path / WEIGHTS)
    return path


def serve(path: Path, timeout_s: float) -> tuple[int, str, float, int]:
    """`graphcache serve --model path` on a free port: (exit code, stderr, seconds, peak RSS bytes).
    The peak is the child's VmHWM, read while it runs: wait4's ru_maxrss would start from this test
    process's own size at the fork (a long pytest run holds over a GiB)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHCACHE_")}
    env["OMP_NUM_THREADS"] = "1"
    err_path = path.parent / "stderr.txt"
    t0 = time.monotonic()
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "graphcache.cli", "serve", "--model", str(path), "--device", "cpu"]
            + ["--host", "127.0.0.1", "--port", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
        peak = 0
        while True:
            peak = max(peak, _high_water_mark(proc.pid))
            pid, status, _usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
                break
            if time.monotonic() - t0 > timeout_s:
                proc.kill()
                proc.wait()
                pytest.fail(f"serve {path} still running after {timeout_s}s:\n{err_path.read_text()[-2000:]}")
            time.sleep(0.05)
    seconds = time.monotonic() - t0
    return proc.returncode, err_path.read_text(), seconds, peak


def _high_water_mark(pid: int) -> int:
    """A running process's peak resident memory (VmHWM), bytes; 0 once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def our_line(stderr: str) -> str:
    """serve's one line, the last of stderr; the only one that starts with "graphcache: "."""
    ours = [line for line in stderr.splitlines() if line.startswith("graphcache: ")]
    assert len(ours) == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ours[0], stderr[-3000:]
    return ours[0]


def refusal(path: Path) -> str:
    """The preflight's refusal of `path`, as serve prints it after "graphcache: "."""
    with pytest.raises(StartupError) as e:
        check_model_dir(path)
    line = str(e.value)
    assert "\n" not in line and len(line) < 600, line
    return line


# --------------------------------------------------------------------------- config.json


@pytest.mark.timeout(120)
def test_a_million_layers_is_refused_at_once_without_growing(tiny, tmp_path):
    path = broken(tiny, tmp_path, {"num_hidden_layers": 1_000_000})
    code, stderr, seconds, peak = serve(path, REFUSED_WITHIN_S + 30)
    assert code == 2, stderr[-3000:]
    line = our_line(stderr)
    assert "num_hidden_layers is 1000000, over the bound 1024" in line, line
    assert "Traceback" not in stderr, stderr[-3000:]
    assert seconds < REFUSED_WITHIN_S, seconds
    assert peak < REFUSED_PEAK_RSS_BYTES, f"peak RSS {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"num_hidden_layers": MAX_LAYERS + 1},
            f"num_hidden_layers is {MAX_LAYERS + 1}, over the bound {MAX_LAYERS}",
        ),
        ({"hidden_size": 1 << 20}, f"hidden_size is {1 << 20}, over the bound {MAX_HIDDEN_SIZE}"),
        (
            {"intermediate_size": 10**7},
            f"intermediate_size is 10000000, over the bound {MAX_INTERMEDIATE_SIZE}",
        ),
        ({"vocab_size": 10**9}, f"vocab_size is 1000000000, over the bound {MAX_VOCAB_SIZE}"),
        ({"num_attention_heads": 4096}, f"num_attention_heads is 4096, over the bound {MAX_HEADS}"),
        ({"num_key_value_heads": 4096}, f"num_key_value_heads is 4096, over the bound {MAX_HEADS}"),
        ({"head_dim": 1 << 16}, "head_dim is 65536, over the bound 1024"),
        ({"max_position_embeddings": 1 << 40}, "max_position_embeddings is 1099511627776, over the bound"),
        ({"num_hidden_layers": 0}, "num_hidden_layers is 0, below the minimum 1"),
        ({"hidden_size": -128}, "hidden_size is -128, below the minimum 1"),
        ({"num_attention_heads": 0}, "num_attention_heads is 0, below the minimum 1"),
        ({"vocab_size": -1}, "vocab_size is -1, below the minimum 1"),
        ({"num_hidden_layers": 4.5}, "malformed field: num_hidden_layers is 4.5, not an integer"),
        ({"num_hidden_layers": "4"}, "malformed field: num_hidden_layers is '4', not an integer"),
        ({"hidden_size": True}, "malformed field: hidden_size is True, not an integer"),
        ({"vocab_size": [1024]}, "malformed field: vocab_size is [1024], not an integer"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
        (
            {"head_dim": None, "hidden_size": 130},
            "hidden_size 130 is not a multiple of num_attention_heads 4",
        ),
        ({"head_dim": 31}, "head_dim is 31, an odd number"),
        ({"rope_theta": 0}, "rope_theta is 0.0, it must be a finite number above 0"),
        ({"rms_norm_eps": "small"}, "malformed field: rms_norm_eps is 'small', not a number"),
        ({"eos_token_id": "x"}, "malformed field: eos_token_id is 'x', not a token id"),
        ({"eos_token_id": 5000}, "eos_token_id 5000 is outside the vocabulary (vocab_size 1024)"),
        ({"architectures": "LlamaForCausalLM"}, "architectures is 'LlamaForCausalLM', not a list"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 0}},
            "rope_scaling factor is 0.0, it must be a finite number above 0",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling (llama3) lacks 'low_freq_factor'",
        ),
    ],
)
def test_a_config_past_plausible_or_inconsistent_is_one_line_naming_field_value_and_bound(
    tiny, tmp_path, change, expected
):
    line = refusal(broken(tiny, tmp_path, change))
    assert expected in line, line
    assert line.startswith(f"model {str(tmp_path / 'bad')!r}: config.json "), line
    assert "; fix config.json or download it again" in line, line


def test_published_sizes_pass(tmp_path):
    """The bounds leave room: a Llama-3.1-405B-sized config and a 262k vocabulary read fine."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 262144,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "eos_token_id": [128001, 128008, 128009],
        "bos_token_id": 128000,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = read_config(tmp_path)
    assert (read.num_layers, read.head_dim, read.vocab_size) == (126, 128, 262144)


# --------------------------------------------------------------------------- the weights


def _narrow_down_proj(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :100].contiguous()


def _drop_k_proj(t: dict[str, torch.Tensor]) -> None:
    del t["model.layers.1.self_attn.k_proj.weight"]


def _truncate(path: Path) -> None:
    weights = path / WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _corrupt_header(path: Path) -> None:
    weights = path / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[8:40] = b"#" * 32  # the JSON header's start
    weights.write_bytes(bytes(data))


WEIGHT_CASES = {
    "shape": (
        dict(tensors=_narrow_down_proj),
        None,
        [
            "shape mismatch for model.layers.0.mlp.down_proj.weight in ",
            f"{WEIGHTS}: checkpoint has (128, 100), config.json implies (128, 384)",
        ],
    ),
    "missing": (
        dict(tensors=_drop_k_proj),
        None,
        [
            "1 tensors missing from the safetensors in ",
            "e.g. model.layers.1.self_attn.k_proj.weight (config.json implies shape (64, 128))",
        ],
    ),
    # config.json promises more than the checkpoint holds: every tensor of layers 4.. is missing.
    "more_layers": (
        dict(config={"num_hidden_layers": 8}),
        None,
        [
            "36 tensors missing",
            "e.g. model.layers.4.self_attn.q_proj.weight (config.json implies shape (128, 128))",
        ],
    ),
    # The config's width, not the checkpoint's: every projection's shape differs.
    "wider": (
        dict(config={"intermediate_size": 512}),
        None,
        ["shape mismatch for model.layers.0.mlp.", "config.json implies (128, 512)"],
    ),
    "truncated": ({}, _truncate, [f"{WEIGHTS} is not a readable safetensors file", "download it again"]),
    "corrupt": ({}, _corrupt_header, [f"{WEIGHTS} is not a readable safetensors file"]),
}


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_weights_that_do_not_match_are_refused_before_allocation(tiny, tmp_path, monkeypatch, case):
    edit, damage, expected = WEIGHT_CASES[case]
    path = broken(tiny, tmp_path, **edit)
    if damage is not None:
        damage(path)
    check_model_dir(path)  # config.json is fine: the preflight lets it through, the loader refuses

    def allocate(*args, **kwargs):
        raise AssertionError("the model's memory was allocated before the checkpoint was checked")

    monkeypatch.setattr(torch.nn.Module, "to_empty", allocate)
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    line = str(e.value)
    assert "\n" not in line and ";" in line, line
    for text in expected:
        assert text in line, line


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["shape", "missing"])
def test_serve_ends_a_weights_mismatch_in_one_line(tiny, tmp_path, case):
    edit, _, expected = WEIGHT_CASES[case]
    code, stderr, seconds, _ = serve(broken(tiny, tmp_path, **edit), LOAD_FAILURE_WITHIN_S)
    assert code == 3, stderr[-3000:]
    line = our_line(stderr)
    assert line.startswith("graphcache: the engine failed to load the model: "), line
    assert "ModelLoadError" not in line, line  # the cause, not its type
    for text in expected:
        assert text in line, line
    assert "the log above has the traceback" not in line, line  # the cause names its fix

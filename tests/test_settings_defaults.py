"""Defaults fit the device: CPU defaults on the CPU, the measured GPU defaults on CUDA (batch limits,
the engine in its own process), and what the user sets always wins (Settings._gpu_defaults); the README's
configuration table and `serve --help` give the same defaults per device."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from graphcache import config
from graphcache.cli import device_defaults, main
from graphcache.config import GPU_BATCH_DEFAULTS, Settings


def test_cpu_keeps_the_small_defaults():
    s = Settings(device="cpu")
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (64, 1024)


def test_cuda_takes_the_gpu_defaults_unless_set():
    s = Settings(device="cuda")
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (
        GPU_BATCH_DEFAULTS["max_num_seqs"],
        GPU_BATCH_DEFAULTS["max_num_batched_tokens"],
    )
    s = Settings(device="cuda", max_num_seqs=32)
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (
        32,
        GPU_BATCH_DEFAULTS["max_num_batched_tokens"],
    )
    s = Settings(device="cuda", max_num_batched_tokens=128)  # rows never exceed an explicit token budget
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (128, 128)


def test_env_counts_as_set(monkeypatch):
    monkeypatch.setenv("GRAPHCACHE_MAX_NUM_SEQS", "16")
    s = Settings(device="cuda")
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (
        16,
        GPU_BATCH_DEFAULTS["max_num_batched_tokens"],
    )


def test_auto_follows_the_machine():  # the real probe: this machine's device
    s = Settings(device="auto")
    memory = config.gpu_memory_bytes()
    large = memory is not None and memory >= config.LARGE_GPU_BYTES
    expected = (64, 1024) if memory is None else (512 if large else 256, 8192)
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == expected


def test_engine_process_defaults_on_with_cuda_at_tp1_only():
    assert Settings(device="cpu").engine.engine_process is False
    assert Settings(device="cuda").engine.engine_process is True
    assert (
        Settings(device="cuda", engine_process=False).engine.engine_process is False
    )  # the user's choice wins
    assert (
        Settings(device="cuda", tensor_parallel_size=2).engine.engine_process is False
    )  # not supported there yet
    assert Settings(device="auto").engine.engine_process is torch.cuda.is_available()


def test_updated_replaces_by_flat_name_and_leaves_the_rest():
    s = Settings(device="cpu", port=8000, cache_max_entries=5)
    t = s.updated(port=9000, cache_max_entries=7)
    assert (t.http.port, t.graph_cache.max_entries, t.http.host) == (9000, 7, s.http.host)
    assert (s.http.port, s.graph_cache.max_entries) == (8000, 5)  # a copy: the original is unchanged
    with pytest.raises(TypeError, match="no_such_setting"):
        s.updated(no_such_setting=1)


@pytest.fixture
def gpu_of(monkeypatch):
    """Pretend the first CUDA device has this many GiB (config.gpu_memory_bytes is the only probe)."""

    def set_memory(gib: float) -> None:
        monkeypatch.setattr(config, "gpu_memory_bytes", lambda: int(gib * 2**30))

    return set_memory


def test_large_gpus_run_twice_the_sequences_with_decode_graphs_to_match(gpu_of):
    gpu_of(141)  # H200
    s = Settings(device="auto")
    assert (s.engine.max_num_seqs, s.engine.max_num_batched_tokens) == (512, 8192)
    assert s.graph_cache.max_capture_size == 512
    assert config.LARGE_GPU_BYTES > 48 * 2**30  # an L40S (48 GB) keeps the 256 defaults
    gpu_of(48)
    s = Settings(device="cuda")
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (256, 256)


def test_what_the_user_sets_wins_on_a_large_gpu(gpu_of):
    gpu_of(80)  # H100
    s = Settings(device="cuda", max_num_seqs=128)
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (128, 256)  # never below 256
    s = Settings(device="cuda", max_capture_size=64)
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (512, 64)
    s = Settings(device="cuda", max_num_seqs=1024)  # captures stop at the measured 512
    assert s.graph_cache.max_capture_size == 512
    s = Settings(device="cuda", max_num_batched_tokens=300)  # rows never exceed an explicit token budget
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (300, 300)
    assert Settings(device="cpu").engine.max_num_seqs == 64  # the CPU is never probed


def test_no_cuda_means_no_gpu_defaults_under_auto(gpu_of, monkeypatch):
    monkeypatch.setattr(config, "gpu_memory_bytes", lambda: None)
    s = Settings(device="auto")
    assert (s.engine.max_num_seqs, s.graph_cache.max_capture_size) == (64, 256)


# --------------------------------------------------------------------------- the README says the same


README = Path(__file__).resolve().parents[1] / "README.md"
DEVICE_DEFAULTS = ("max_num_seqs", "max_num_batched_tokens", "max_capture_size")
CLAUSE = re.compile(
    r"(?P<value>\d+) on (?P<where>the CPU|CUDA GPUs under (?P<under>\d+) GiB|GPUs of (?P<over>\d+) GiB or more|CUDA)"
)


def readme_defaults() -> dict[str, str]:
    """The configuration table's default column by setting, backticks dropped."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[A-Z_]+`", cells[0]):
            rows[cells[0].strip("`").lower()] = cells[1].replace("`", "")
    return rows


def stated(text: str) -> dict[str, int]:
    """ "64 on the CPU, 256 on CUDA GPUs under 70 GiB, 512 on GPUs of 70 GiB or more" -> the value per device
    kind: cpu, small (a GPU under the threshold), large; "on CUDA" covers both GPU sizes."""
    out: dict[str, int] = {}
    for match in CLAUSE.finditer(text):
        value, where = int(match["value"]), match["where"]
        threshold = match["under"] or match["over"]
        if threshold is not None:
            assert int(threshold) * 2**30 == config.LARGE_GPU_BYTES, text
        kinds = {"the CPU": ["cpu"], "CUDA": ["small", "large"]}.get(where) or (
            ["small"] if match["under"] else ["large"]
        )
        out.update(dict.fromkeys(kinds, value))
    return out


def default_of(settings: Settings, name: str) -> int:
    section = settings.graph_cache if name == "max_capture_size" else settings.engine
    return getattr(section, name)


def test_readme_defaults_per_device_match_help_and_the_code(gpu_of, capsys, monkeypatch):
    """The README's configuration table, `graphcache serve --help` and Settings agree on the defaults that
    follow the device: on the CPU, on a GPU under the large-GPU threshold, and on a 70 GiB GPU."""
    for name in DEVICE_DEFAULTS:
        monkeypatch.delenv("GRAPHCACHE_" + name.upper(), raising=False)
    rows = readme_defaults()
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in DEVICE_DEFAULTS:
        assert name in rows, f"README's configuration table has no row for {name.upper()}"
        assert rows[name] == device_defaults(name), (name, rows[name])
        assert f"GRAPHCACHE_{name.upper()}; default: {rows[name]}]" in help_text, name
        values = stated(rows[name])
        assert set(values) == {"cpu", "small", "large"}, (name, rows[name])
        assert default_of(Settings(device="cpu"), name) == values["cpu"], name
        gpu_of(70)  # the threshold itself counts as large
        assert default_of(Settings(device="cuda"), name) == values["large"], name
        assert default_of(Settings(device="auto"), name) == values["large"], name
        gpu_of(48)
        assert default_of(Settings(device="cuda"), name) == values["small"], name

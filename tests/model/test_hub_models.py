"""`graphcache serve MODEL` with a Hugging Face hub id (issue 25): the model setting classified (local
directory or hub id), the real huggingface_hub code path against a hub cache laid out as the library
writes it (HF_HUB_OFFLINE=1) and against a hub API on a loopback port, errors that name the fix, the
served name, and /ready's "downloading" phase before "loading".

The library reads HF_HOME, HF_HUB_OFFLINE and its timeouts when it is imported, so everything that
depends on them runs in a fresh interpreter with its own environment (helpers_hub)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from graphcache.api.server.app import create_app
from graphcache.cli import StartupError, build_parser, main, settings_from_args
from graphcache.config import Settings
from graphcache.engine.loop import engine as engine_module
from graphcache.engine.loop.engine import Engine
from graphcache.metrics import Metrics
from graphcache.model.source import ModelSourceError, _Reporter, model_source, served_name
from graphcache.model.tiny import make_default_model
from helpers_hub import COMMIT, FakeHub, hub_env, resolve_in_subprocess, write_hub_cache

REPO = "org/tiny-model"
LOAD_LIMIT_S = 180  # a server start imports torch and loads the tiny model: seconds, more on a busy box


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_default_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture
def hf_home(tmp_path, tiny):
    """HF_HOME whose hub cache holds the tiny model as REPO (main -> COMMIT)."""
    write_hub_cache(tmp_path / "hf", REPO, tiny)
    return tmp_path / "hf"


def pythonpath_env(env: dict[str, str]) -> dict[str, str]:
    import os

    if "PYTHONPATH" in os.environ:  # the worktree's package, as the test process imports it
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


# --------------------------------------------------------------------------- local path or hub id


def test_an_existing_directory_is_local_even_if_it_looks_like_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    source = model_source("org/name")
    assert source.local is not None and not source.is_hub
    assert served_name("org/name") == "name"


@pytest.mark.parametrize("spec", ["Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.1-8B", "a_b/c.d-e"])
def test_org_name_without_such_a_directory_is_a_hub_id(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = model_source(spec)
    assert source.is_hub and source.repo_id == spec and source.local is None
    assert served_name(spec) == spec  # clients load the tokenizer by this name


@pytest.mark.parametrize(
    "spec", ["/no/such/dir", "./org/name", "../x", "~/no-such-model", "a/b/c", "bare", "org/"]
)
def test_a_path_that_does_not_exist_is_an_error_naming_it(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError) as e:
        model_source(spec)
    message = str(e.value)
    assert f"{spec!r} does not exist" in message and "org/name" in message and "\n" not in message


def test_cli_refuses_a_missing_path_before_loading(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "hub id" in err[0]


# --------------------------------------------------------------------------- serve MODEL


def parse(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_positional_model_is_the_model_setting(monkeypatch, tmp_path):
    monkeypatch.delenv("GRAPHCACHE_MODEL", raising=False)
    assert parse("Qwen/Qwen2.5-0.5B-Instruct").model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert parse("--port", "0", "org/x", "--revision", "v2").model.revision == "v2"
    assert parse("--model", "org/x").model.path == "org/x"  # the flag still works
    assert parse("org/x", "--model", "org/x").model.path == "org/x"  # both, the same: fine
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    assert parse("./m", "--model", "m").model.path == "./m"  # one directory written two ways
    monkeypatch.setenv("GRAPHCACHE_MODEL", "org/from-env")
    assert parse("org/from-flag").model.path == "org/from-flag"  # a flag beats env


def test_positional_and_flag_that_differ_are_refused(capsys):
    with pytest.raises(StartupError, match="different models; pass the model once"):
        parse("org/a", "--model", "org/b")
    assert main(["serve", "org/a", "--model", "org/b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'org/a'" in err[0] and "'org/b'" in err[0]


def test_revision_env(monkeypatch):
    monkeypatch.setenv("GRAPHCACHE_REVISION", "abc123")
    assert Settings().model.revision == "abc123"
    monkeypatch.setenv("GRAPHCACHE_REVISION", "")
    assert Settings().model.revision is None


# --------------------------------------------------------------------------- the real library, offline


def test_offline_cache_resolves_to_the_snapshot(hf_home):
    out = resolve_in_subprocess(REPO, pythonpath_env(hub_env(hf_home, HF_HUB_OFFLINE="1")))
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    folder = out.stdout.strip().splitlines()[-1]
    assert folder == str(hf_home / "hub" / "models--org--tiny-model" / "snapshots" / COMMIT)


def test_offline_without_the_model_names_the_fix(hf_home):
    out = resolve_in_subprocess("org/not-cached", pythonpath_env(hub_env(hf_home, HF_HUB_OFFLINE="1")))
    assert out.returncode == 3, out.stdout + out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert "'org/not-cached' is not in the Hugging Face cache" in line
    assert "unset HF_HUB_OFFLINE" in line and "`hf download org/not-cached`" in line


def test_no_network_names_the_fix(hf_home):
    """HF_ENDPOINT at a closed loopback port, short timeouts: a model not in the cache is an error that
    names the offline cache and a local directory; one in the cache is served from it."""
    with socket_closed_port() as port:
        env = pythonpath_env(
            hub_env(
                hf_home,
                HF_ENDPOINT=f"http://127.0.0.1:{port}",
                HF_HUB_ETAG_TIMEOUT="2",
                HF_HUB_DOWNLOAD_TIMEOUT="2",
            )
        )
        missing = resolve_in_subprocess("org/not-cached", env)
        cached = resolve_in_subprocess(REPO, env)
    assert missing.returncode == 3, missing.stdout + missing.stderr[-2000:]
    line = missing.stdout.strip().splitlines()[-1]
    assert "cannot be reached" in line and "HF_HUB_OFFLINE=1" in line and "local model directory" in line
    assert cached.returncode == 0, cached.stdout + cached.stderr[-2000:]
    assert cached.stdout.strip().splitlines()[-1].endswith(COMMIT)


class socket_closed_port:
    """A loopback port nobody listens on (bound, then closed: connections are refused)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        pass


# --------------------------------------------------------------------------- the real library, a hub API


@pytest.mark.parametrize("cut_once", [(), ("tokenizer.json",)], ids=["clean", "a-dropped-connection"])
def test_download_from_a_hub_writes_the_cache_and_reports_progress(tmp_path, tiny, cut_once):
    hf_home = tmp_path / "hf"
    with FakeHub({REPO: tiny}, cut_once=cut_once) as hub:
        out = resolve_in_subprocess(REPO, pythonpath_env(hub_env(hf_home, HF_ENDPOINT=hub.url)))
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    # (a busy machine may retry on its own: only the cut-off run is sure to)
    assert "Trying to resume download" in out.stderr or not cut_once, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    reports = [json.loads(line.removeprefix("PROGRESS ")) for line in lines if line.startswith("PROGRESS ")]
    folder = lines[-1]
    assert folder.endswith(COMMIT)
    # Only the files the server reads: config, generation config, tokenizer files and the weights.
    snapshot_files = sorted(
        p.name for p in (hf_home / "hub" / "models--org--tiny-model" / "snapshots" / COMMIT).iterdir()
    )
    assert snapshot_files == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    last = reports[-1]
    fetched = sum((tiny / name).stat().st_size for name in snapshot_files)
    assert last["files_done"] == last["files_total"] == 5, reports
    assert last["bytes_done"] == last["bytes_total"] == fetched, reports
    assert all(r["bytes_done"] <= r["bytes_total"] for r in reports), reports
    # What was downloaded is a cache the library reads back offline.
    again = resolve_in_subprocess(REPO, pythonpath_env(hub_env(hf_home, HF_HUB_OFFLINE="1")))
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == folder


def test_a_total_the_library_lost_never_reads_below_the_bytes_done():
    """snapshot_download grows its byte bars' totals by assignment from each download thread: two files
    starting at once can lose one's size. The reports stay sane, and the last one is exact."""
    reports: list[dict] = []
    reporter = _Reporter(REPO, reports.append)
    bar_class = reporter.bar_class()
    transfer = bar_class(total=0, unit="B")
    reconstruct = bar_class(total=0, unit="B")
    reconstruct.total = transfer.total = 100  # a second file's 50 bytes lost from the total
    transfer.total = 200  # the transfer bar pads its total past the bytes seen
    for _ in range(3):
        reconstruct.update(50)
        transfer.update(50)
    reporter.finish()
    assert all(r["bytes_done"] <= r["bytes_total"] for r in reports), reports
    assert reports[-1]["bytes_done"] == reports[-1]["bytes_total"] == 150, reports


def test_the_last_report_is_what_the_cache_gained_when_the_bars_fell_short():
    """The bars can end short of the bytes fetched (the library updates them from its download threads: CI saw
    one small file's 581 bytes missing); the last report takes the bytes the hub cache gained instead."""
    reports: list[dict] = []
    reporter = _Reporter(REPO, reports.append)
    bar = reporter.bar_class()(total=0, unit="B")
    bar.update(4_260_137)
    reporter.finish(4_260_718)
    assert reports[-1]["bytes_done"] == reports[-1]["bytes_total"] == reporter.bytes_done == 4_260_718


@pytest.mark.parametrize(
    "repo, revision, expected",
    [
        ("org/missing", None, ["'org/missing' was not found, or is private", "HF_TOKEN"]),
        ("org/gated", None, ["'org/gated' is gated", "set HF_TOKEN"]),
        (REPO, "no-such-branch", ["has no revision 'no-such-branch'", "--revision (GRAPHCACHE_REVISION)"]),
    ],
)
def test_hub_errors_name_the_fix(tmp_path, tiny, repo, revision, expected):
    with FakeHub({REPO: tiny}, gated=("org/gated",)) as hub:
        out = resolve_in_subprocess(
            repo, pythonpath_env(hub_env(tmp_path / "hf", HF_ENDPOINT=hub.url)), revision
        )
    assert out.returncode == 3, out.stdout + out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    for text in expected:
        assert text in line, line


# --------------------------------------------------------------------------- /ready while downloading


async def test_ready_says_downloading_before_loading(monkeypatch, tiny):
    """The engine fetches a hub id before it loads: /ready's body shows the download's progress, then
    the runner gets the snapshot directory and the served name stays the hub id."""
    reached, release = threading.Event(), threading.Event()
    loaded_from: list[str] = []

    def fake_fetch(repo_id, revision, progress):
        assert (repo_id, revision) == (REPO, "v1")
        progress({"files_done": 2, "files_total": 5, "bytes_done": 10, "bytes_total": 100})
        reached.set()
        release.wait(30)
        return tiny

    def runner_factory(settings, metrics):
        loaded_from.append(settings.model.path)
        raise RuntimeError("stop here; this test only looks at the phases")

    monkeypatch.setattr(engine_module, "fetch_hub_model", fake_fetch)
    e = Engine(Settings(model=REPO, revision="v1", device="cpu"), Metrics(), runner_factory=runner_factory)
    assert e.model_name == REPO
    app = create_app(e.settings, engine=e)
    e.start()
    try:
        assert reached.wait(30)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.get("/ready")
        assert r.status_code == 503
        assert r.json() == {
            "status": "loading",
            "progress": {
                "phase": "downloading",
                "model": REPO,
                "files_done": 2,
                "files_total": 5,
                "bytes_done": 10,
                "bytes_total": 100,
            },
        }
    finally:
        release.set()
        e.wait_ready(30)
        e.shutdown(10)
    assert loaded_from == [str(tiny)]
    assert e.model_name == REPO


# --------------------------------------------------------------------------- the server, end to end


def start_server(args: list[str], env: dict[str, str], log_path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "wb")  # noqa: SIM115 - the server writes it until the test stops it
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphcache.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, log_path) -> None:
    deadline = time.monotonic() + LOAD_LIMIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"not ready within {LOAD_LIMIT_S}s: {log_path.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--no-engine-process", "--engine-process"])
def test_serve_a_hub_id_from_the_offline_cache(hf_home, tmp_path, mode):
    env = pythonpath_env(hub_env(hf_home, HF_HUB_OFFLINE="1", GRAPHCACHE_CACHE_DIR=str(tmp_path / "gc")))
    log_path = tmp_path / "server.log"
    proc, url = start_server(
        [
            REPO,
            "--device",
            "cpu",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            mode,
        ],
        env,
        log_path,
    )
    try:
        wait_ready(proc, url, log_path)
        card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        assert card["id"] == REPO and card["root"] == REPO
        answer = httpx.post(
            url + "/v1/completions",
            json={"model": REPO, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == REPO and answer.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(30)
    log = log_path.read_text()
    assert f"model {REPO} (revision main): from the Hugging Face cache, downloading what it lacks" in log
    assert str(hf_home / "hub" / "models--org--tiny-model" / "snapshots" / COMMIT) in log


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--no-engine-process", "--engine-process"])
def test_serve_a_hub_id_missing_offline_exits_naming_the_fix(tmp_path, mode):
    env = pythonpath_env(
        hub_env(tmp_path / "hf", HF_HUB_OFFLINE="1", GRAPHCACHE_CACHE_DIR=str(tmp_path / "gc"))
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphcache.cli",
            "serve",
            "org/not-cached",
            "--device",
            "cpu",
            "--port",
            "0",
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=LOAD_LIMIT_S,
        env=env,
    )
    assert out.returncode == 3, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("graphcache: the engine failed to load the model: ")
    assert "'org/not-cached' is not in the Hugging Face cache" in last and "unset HF_HUB_OFFLINE" in last

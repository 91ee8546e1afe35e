"""A `vllm serve` command line starts graphcache (issue 39 item 3): the real server process, on the CPU with
the embedded tiny model, given vLLM's flags after `serve`; it becomes ready, serves, and says in one warning
line per flag what it does instead where it does not do what vLLM would."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from .support import PYTHON, REPO, ServerProcess

# `python -c SCRIPT serve --port N` passes `serve --port N` as sys.argv[1:]; the vLLM flags follow.
LAUNCH = (
    "import json, sys; from graphcache.cli import main; sys.exit(main(sys.argv[1:] + json.loads({argv!r})))"
)

ISSUE_LINE = [
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--gpu-memory-utilization",
    "0.9",
    "--max-num-batched-tokens",
    "8192",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def vllm_server(cache_dir: Path, log_dir: Path, name: str, argv: list[str], **settings: Any) -> ServerProcess:
    proc = ServerProcess(cache_dir, log_dir, name=name, device="cpu", **settings)
    proc.command = [PYTHON, "-c", LAUNCH.format(argv=json.dumps(argv))]
    return proc


def warning_lines(proc: ServerProcess) -> list[str]:
    return [line for line in proc.log_path.read_text(errors="replace").splitlines() if "vLLM flag" in line]


def test_the_issues_vllm_command_line_starts_and_serves_tools(cache_dir, log_dir):
    proc = vllm_server(cache_dir, log_dir, "vllm-issue-line", ISSUE_LINE)
    try:
        proc.start()
        answer = httpx.post(
            proc.base_url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [WEATHER],
                "tool_choice": "auto",
                "max_tokens": 8,
            },
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] in {"stop", "length", "tool_calls"}
        assert warning_lines(proc) == []  # each of these flags does what vLLM's does
    finally:
        proc.stop()


def test_a_long_vllm_deployment_line_starts_with_one_warning_per_flag_handled_otherwise(
    cache_dir, log_dir, tmp_path
):
    model = tmp_path / "tiny"
    subprocess.run([PYTHON, "-m", "graphcache.cli", "make-tiny-model", str(model)], check=True, cwd=REPO)
    argv = [
        str(model),
        "--served-model-name",
        "tiny",
        "--tokenizer",
        str(model),
        "--trust-remote-code",
        "--dtype",
        "auto",
        "--max-model-len",
        "1k",
        "--gpu-memory-utilization",
        "0.9",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "8192",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--disable-log-requests",
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
        "--swap-space",
        "4",
        "--kv-cache-dtype",
        "auto",
        "--seed",
        "0",
        "--tensor-parallel-size",
        "1",
        "--pipeline-parallel-size",
        "1",
        "--distributed-executor-backend",
        "mp",
        "--load-format",
        "auto",
        "--generation-config",
        "auto",
        "--response-role",
        "assistant",
        "--max-log-len",
        "100",
        "--enforce-eager",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--download-dir",
        str(tmp_path / "hub"),
    ]
    proc = vllm_server(cache_dir, log_dir, "vllm-deployment-line", argv)
    try:
        proc.start()
        models = httpx.get(proc.base_url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        done = httpx.post(
            proc.base_url + "/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 4},
            timeout=60,
        )
        assert done.status_code == 200, done.text
        lines = warning_lines(proc)
        for flag in ("--trust-remote-code", "--uvicorn-log-level warning", "--swap-space 4"):
            assert len([line for line in lines if f"vLLM flag {flag}:" in line]) == 1, (flag, lines)
        assert len(lines) == 3, lines
    finally:
        proc.stop()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--pipeline-parallel-size", "2"], "--tensor-parallel-size"),
        (["--ssl-keyfile", "/k.pem"], "terminate TLS"),
    ],
)
def test_a_vllm_flag_graphcache_cannot_honour_stops_the_start_in_one_line(argv, says):
    out = subprocess.run(
        [PYTHON, "-m", "graphcache.cli", "serve", "--port", "0", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in out.stderr, out.stderr

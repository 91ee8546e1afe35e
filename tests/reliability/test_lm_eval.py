"""lm-eval's `local-completions` model against a live server, as users run it (issue 12's done-when):
a loglikelihood task (multiple choice: echo + prompt logprobs) and a generate_until task, with
--batch_size above 1 (batched prompts in one request). The tasks read tests/local_tasks/ (there is
no dataset hub here). Random weights: the scores mean nothing; that every request is answered and
every score is computed is the test, plus the loglikelihoods lm-eval read equal the server's own
prompt logprobs for one sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[2]
TASKS = ("graphcache_tiny_qa_mc", "graphcache_tiny_qa_gen")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lm-eval") / "tiny"
    env = {**os.environ, "PYTHONPATH": str(REPO / "service")}
    subprocess.run(
        [sys.executable, "-m", "graphcache", "make-tiny-model", str(path)],
        check=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    return path


@pytest.mark.timeout(900)
def test_lm_eval_local_completions_loglikelihood_and_generate_until(server_factory, model_dir, tmp_path):
    server = server_factory(model=str(model_dir), served_model_name="tiny", max_num_seqs=8)
    out = tmp_path / "lm_eval"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "OMP_NUM_THREADS": "1",
    }
    model_args = (
        f"model=tiny,base_url={server.base_url}/v1/completions,tokenizer={model_dir},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    )
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        "tests/local_tasks",
        "--batch_size",
        "4",
        "--output_path",
        str(out),
        "--log_samples",
    ]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, f"lm_eval failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"

    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["graphcache_tiny_qa_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["graphcache_tiny_qa_gen"]["exact_match,none"] <= 1.0
    samples = [json.loads(line) for line in next(out.rglob("samples_graphcache_tiny_qa_mc_*.jsonl")).open()]
    assert len(samples) == 10 and all(len(s["resps"]) == 3 for s in samples)  # 3 choices each, all scored

    # One loglikelihood lm-eval read equals the server's own echo logprobs for that continuation, sent as
    # lm-eval sends it: context ids + continuation ids (no special tokens), one token generated.
    first = samples[0]
    context, continuation = (
        first["arguments"]["gen_args_0"]["arg_0"],
        first["arguments"]["gen_args_0"]["arg_1"],
    )

    def ids(text: str) -> list[int]:
        r = httpx.post(
            f"{server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60
        )
        return r.json()["tokens"]

    context_ids, continuation_ids = ids(context), ids(continuation)
    body = {
        "model": "tiny",
        "prompt": context_ids + continuation_ids,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    lp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0][
        "logprobs"
    ]
    expected = sum(lp["token_logprobs"][len(context_ids) : -1])
    assert float(first["resps"][0][0][0]) == pytest.approx(expected, abs=1e-3)

"""graphcache replicas behind vLLM's router (`vllm-router`), routed by policy, on a shared-prefix workload.

Starts N `graphcache serve` replicas on loopback ports, each publishing its KV cache events
(--kv-events-config, ZMQ PUB + replay), then for each policy a `vllm-router` in front of them, and sends
a workload of a few dozen system prompts with many user turns (prompts as token ids, so `kv_aware` knows
a request's tokens; `cache_aware` matches the same requests by their text-free token list too). Each
policy gets fresh replicas (empty caches). Reported per policy, side by side: requests and prefix-cache
hit ratio per replica, the hit ratio summed over the replicas, the prefill tokens computed, TTFT (p50,
p95; streamed requests), throughput and errors.

CPU (the embedded tiny model, CI's size):
    python benchmarks/router_bench.py --policies round_robin cache_aware kv_aware
GPU (two replicas sharing one H200, half the KV each; scripts/gpu_check.sh phase `router`):
    python benchmarks/router_bench.py --replicas 2 --make-qwen05b /tmp/qwen05b --device cuda --kv-blocks 0 \
        --replica-setting gpu_memory_utilization=0.4 --requests 2000 --concurrency 32

Library (tests/deploy/test_router.py): Replica, Router, Workload, run_policy.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def router_binary() -> str:
    """vllm-router beside this Python (a venv), else on PATH (a --target install's bin/)."""
    local = Path(sys.executable).parent / "vllm-router"
    found = str(local) if local.exists() else shutil.which("vllm-router")
    if found is None:
        raise SystemExit("vllm-router not found: pip install vllm-router==0.1.17")
    return found


CORPUS = REPO / "service" / "graphcache" / "model" / "data" / "corpus.txt"
MODEL_NAME = "bench"  # every replica serves its model under this name (the router's --kv-event-model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready within {timeout_s}s:\n{tail(log)}")


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Replica:
    """One `graphcache serve` on a loopback port, publishing KV events on two more."""

    def __init__(self, name: str, log_dir: Path, settings: dict[str, Any]) -> None:
        self.name, self.log = name, log_dir / f"{name}.log"
        self.port, self.kv_port, self.replay_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
        }
        self.settings = {
            "host": "127.0.0.1",
            "log_level": "warning",
            "served_model_name": MODEL_NAME,
            **settings,
            "kv_events_config": json.dumps(events),
        }
        self.proc: subprocess.Popen | None = None

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def start(self, timeout_s: float = 180) -> Replica:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHCACHE_")}
        for key, value in self.settings.items():
            env["GRAPHCACHE_" + key.upper()] = value if isinstance(value, str) else json.dumps(value)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "graphcache.cli", "serve", "--port", str(self.port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_http(self.url + "/ready", self.proc, timeout_s, self.name, self.log)
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, grace_s: float = 15) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def counters(self) -> dict[str, float]:
        """vLLM's prefix-cache and request counters from /metrics, summed over their labels."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        want = {
            "vllm:prefix_cache_queries_total": "queries",
            "vllm:prefix_cache_hits_total": "hits",
            "vllm:request_success_total": "requests",
        }
        out = dict.fromkeys(want.values(), 0.0)
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in want:
                out[want[name]] += float(line.rsplit(" ", 1)[1])
        return out


class Router:
    """`vllm-router` in front of the replicas: the policy, retries, and a 1 s health check."""

    def __init__(self, replicas: list[Replica], policy: str, log_dir: Path, extra: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"router-{policy}-{self.port}.log"
        self.args = [
            router_binary(),
            *("--host", "127.0.0.1", "--port", str(self.port), "--policy", policy),
            *("--worker-urls", *[r.url for r in replicas]),
            *("--health-check-interval-secs", "1", "--health-failure-threshold", "2"),
            *("--health-success-threshold", "1", "--health-check-endpoint", "/health"),
            *("--worker-startup-check-interval", "1", "--retry-max-retries", "5"),
            *("--retry-initial-backoff-ms", "50", "--retry-max-backoff-ms", "1000"),
            *("--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "2"),
            *("--prometheus-port", str(free_port()), "--log-level", "info"),
        ]
        if policy == "kv_aware":
            for r in replicas:
                self.args += ["--kv-event-source", f"{r.url}={r.kv_endpoint}"]
                self.args += ["--kv-event-replay-source", f"{r.url}={r.replay_endpoint}"]
            block_size = str(replicas[0].settings.get("block_size", 16))
            self.args += ["--kv-event-block-size", block_size, "--kv-event-model", MODEL_NAME]
        self.args += extra or []
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> Router:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_http(self.url + "/health", self.proc, timeout_s, "vllm-router", self.log)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class Workload:
    """`systems` system prompts of `system_words` words; each request one of them (uniformly) + a user turn."""

    systems: int = 24
    system_words: int = 110
    user_words: int = 6
    requests: int = 360
    concurrency: int = 4
    max_tokens: int = 4
    seed: int = 0

    def prompts(self, tokenize_url: str) -> list[list[int]]:
        rng = random.Random(self.seed)
        words = CORPUS.read_text().split()
        systems = [" ".join(rng.choice(words) for _ in range(self.system_words)) for _ in range(self.systems)]
        out = []
        with httpx.Client(timeout=30) as client:
            for n in range(self.requests):
                user = " ".join(rng.choice(words) for _ in range(self.user_words))
                text = f"{rng.choice(systems)}\nUser {n}: {user}\nAssistant:"
                body = {"model": MODEL_NAME, "prompt": text}
                out.append(client.post(tokenize_url + "/tokenize", json=body).json()["tokens"])
        return out


@dataclass
class Outcome:
    status: int | str  # HTTP status, or the client-side error's name
    ttft_s: float | None = None


def send(url: str, prompt: list[int], max_tokens: int, timeout_s: float = 60, stream: bool = True) -> Outcome:
    """One completion (streamed: with its time to first token). Never raises, never hangs: a client-side
    failure is the error's name, a stream that ends without [DONE] is "truncated"."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    t0 = time.perf_counter()
    try:
        if not stream:
            resp = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
            if resp.status_code == 200:
                resp.json()["choices"][0]["text"]  # a whole answer, or the KeyError/ValueError below names it
            return Outcome(resp.status_code)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                resp.read()
                return Outcome(resp.status_code)
            ttft = None
            done = False
            for line in resp.iter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.perf_counter() - t0
                done = done or line == "data: [DONE]"
            return Outcome(200 if done else "truncated", ttft)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Outcome(type(e).__name__)


@dataclass
class PolicyReport:
    policy: str
    per_replica: list[dict[str, float]] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def queries(self) -> float:
        return sum(r["queries"] for r in self.per_replica)

    @property
    def hits(self) -> float:
        return sum(r["hits"] for r in self.per_replica)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def prefill_computed(self) -> float:
        """Prompt tokens the replicas computed (looked up and not found), summed."""
        return self.queries - self.hits

    def ttft_ms(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        return (
            1000 * statistics.quantiles(self.ttfts, n=100)[int(q * 100) - 1] if len(self.ttfts) > 1 else 0.0
        )


def run_load(url: str, prompts: list[list[int]], workload: Workload) -> tuple[list[Outcome], float]:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(workload.concurrency) as pool:
        outcomes = list(pool.map(lambda p: send(url, p, workload.max_tokens), prompts))
    return outcomes, time.perf_counter() - t0


def run_policy(
    policy: str, workload: Workload, replica_settings: dict[str, Any], log_dir: Path, replicas: int = 3
) -> PolicyReport:
    """Fresh replicas (empty caches), a router with `policy`, the workload; the report."""
    reps = [Replica(f"{policy}-r{i}", log_dir, replica_settings) for i in range(replicas)]
    router = None
    try:
        for r in reps:
            r.start()
        prompts = workload.prompts(reps[0].url)
        before = [r.counters() for r in reps]  # /tokenize costs nothing here, but be exact
        router = Router(reps, policy, log_dir).start()
        outcomes, wall = run_load(router.url, prompts, workload)
        after = [r.counters() for r in reps]
        report = PolicyReport(policy, wall_s=wall)
        report.per_replica = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
        report.ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
        for o in outcomes:
            report.statuses[str(o.status)] = report.statuses.get(str(o.status), 0) + 1
        return report
    finally:
        if router is not None:
            router.stop()
        for r in reps:
            r.stop()


def table(reports: list[PolicyReport]) -> str:
    rows = [
        ("policy", "requests per replica", "hit ratio per replica", "hit ratio", "prefill computed",
         "TTFT p50 ms", "TTFT p95 ms", "req/s", "statuses"),
    ]  # fmt: skip
    for r in reports:
        reqs = " / ".join(f"{x['requests']:.0f}" for x in r.per_replica)
        ratios = " / ".join(f"{x['hits'] / x['queries']:.2f}" if x["queries"] else "-" for x in r.per_replica)
        total = sum(r.statuses.values())
        rows.append(
            (r.policy, reqs, ratios, f"{r.hit_ratio:.2f}", f"{r.prefill_computed:.0f}",
             f"{r.ttft_ms(0.5):.1f}", f"{r.ttft_ms(0.95):.1f}", f"{total / r.wall_s:.1f}", json.dumps(r.statuses))
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


CPU_REPLICA = {
    "device": "cpu",
    "block_size": 16,
    "num_kv_blocks": 200,  # 3,200 tokens: half the 24 system prompts' ~6,400, more than a third of them
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "drain_timeout_s": 10,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware", "kv_aware"])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--requests", type=int, default=360)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--systems", type=int, default=24)
    ap.add_argument("--system-words", type=int, default=110)
    sys.path.insert(0, str(REPO))  # benchmarks/ is a folder of scripts, not an installed package
    from benchmarks.model_shapes import add_model_args, resolve_model

    add_model_args(ap)  # --model DIR, --make-qwen05b DIR (default: the embedded tiny model)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-blocks", type=int, default=200, help="KV blocks per replica; 0: sized from memory")
    ap.add_argument("--replica-setting", action="append", default=[], help="NAME=VALUE, a graphcache setting")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/router-bench"))
    ap.add_argument("--out", type=Path, help="write the reports as JSON")
    args = ap.parse_args()
    settings: dict[str, Any] = {**CPU_REPLICA, "device": args.device}
    if args.kv_blocks:
        settings["num_kv_blocks"] = args.kv_blocks
    else:
        settings.pop("num_kv_blocks")
    model = resolve_model(args)
    if model is not None:
        settings["model"] = str(model)
    for item in args.replica_setting:
        key, _, value = item.partition("=")
        settings[key] = value
    args.log_dir.mkdir(parents=True, exist_ok=True)
    workload = Workload(args.systems, args.system_words, requests=args.requests, concurrency=args.concurrency)
    reports = [run_policy(p, workload, settings, args.log_dir, args.replicas) for p in args.policies]
    print(table(reports))
    if args.out:
        args.out.write_text(json.dumps([{**vars(r), "hit_ratio": r.hit_ratio} for r in reports], indent=1))


if __name__ == "__main__":
    main()

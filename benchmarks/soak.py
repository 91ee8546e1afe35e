"""Soak (issue 14): the real server under mixed load and faults for --duration s; nothing may be lost.

    python benchmarks/soak.py --make-qwen05b /tmp/qwen05b --duration 300 --out soak.json   # the H200 run
    python benchmarks/soak.py --duration 30 --out soak_cpu.json                             # CPU smoke

Server A is `graphcache serve` (through benchmarks/failpoint_serve.py: the same command plus a
file-armed capture failpoint and a memory sampler) with a small KV cache (--num-kv-blocks). While
--clients closed-loop clients send streaming and non-streaming completions and chats (token-id and
text prompts of mixed length, ignore_eos, so the right token count is known), and some streams are
left after a few chunks (client disconnect); --structured-share of them carry an output constraint
(guided_regex / guided_json / guided_choice / response_format, and now and then a regex bomb, which
must be a clean 400) and --template-share of the chats their own chat_template (the server trusts
request templates; now and then a hostile one: past the sandbox's size limits, the render time limit
or the memory limit, which must be a clean 400), the soak:
  * every --admin-period s: arms the failpoint (every capture fails, the step runs eagerly) for half
    the period, disarms it, POST /admin/clear (pool bytes must drop to 0), POST /admin/warmup {} (pool
    bytes must come back to the baseline pinned at startup);
  * every --burst-period s: --burst-size long requests at once, more than the KV cache holds: preemption
    (and refusals of what can never fit, which must be clean 400s).
Outcomes per request: finished (exact token count, finish_reason length), left (our disconnect),
refused (an HTTP error with an OpenAI error body, by status), lost (anything else: transport error,
timeout, truncated or malformed stream, wrong count): lost must be 0.
At the end: memory (RSS, cuda allocated/reserved) at start, after the first minute (or a fifth of the
run) and at the end, after a final clear + warmup; greedy outputs of a fixed probe set at start and end
on A, and on server B (same settings, enforce_eager=true) must all be equal. Table and JSON (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOKEN = "soak-token"
PROBES = [
    "The quick brown fox",
    "Once upon a time, in a city built on graphs,",
    "hello",
    "Numbers: 1 2 3 4 5 6 7 8 9 10",
    "Q: What is a KV block? A:",
    "A cache that forgets nothing is",
]
# Output constraints of the structured-output mix: (field, value). A constrained request may end "stop"
# when its grammar completes: then it may have fewer tokens than max_tokens.
STRUCTURED = [
    ("guided_regex", "[a-z ]+"),
    (
        "guided_json",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "tags"],
        },
    ),
    ("guided_choice", ["alpha", "beta", "gamma delta"]),
    (
        "response_format",
        {
            "type": "json_schema",
            "json_schema": {
                "name": "point",
                "schema": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                },
            },
        },
    ),
]
BOMB = ("guided_regex", "a{1000}{1000}")  # refused (400) in well under a second, never cached
# Chats of the template mix bring their own chat_template (the server trusts request templates); a few
# are hostile and must be clean 400s while everything else is served: one the sandbox refuses at once,
# one that runs into the render time limit (its worker is killed), one past the memory limit.
TEMPLATES = [
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% for m in messages %}[{{ m['role']|upper }}] {{ m['content']|trim }}\n{% endfor %}[ASSISTANT] ",
    "{{ bos_token }}{% for m in messages %}{% if loop.first %}### {% endif %}{{ m['content'] }}{% endfor %}\n",
]
HOSTILE_TEMPLATES = [
    "{{ 7 ** 10000000 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
]
TEMPLATE_TIMEOUT_S = 2.0
WORDS = [
    "graph",
    "cache",
    "block",
    "token",
    "batch",
    "replay",
    "capture",
    "decode",
    "prefill",
    "stream",
    "server",
    "request",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process: start, wait for /ready, memory samples, admin calls, SIGTERM."""

    def __init__(self, args, name: str, eager: bool) -> None:
        self.name, self.port = name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.fail_file = Path(args.log_dir) / f"soak_{name}.fail"
        self.stats_file = Path(args.log_dir) / f"soak_{name}.stats.json"
        self.fail_file.unlink(missing_ok=True)
        for stale in (self.stats_file, self.stats_file.with_suffix(".engine.json")):
            stale.unlink(missing_ok=True)
        env = dict(
            os.environ,
            GRAPHCACHE_PORT=str(self.port),
            GRAPHCACHE_HOST="127.0.0.1",
            GRAPHCACHE_ADMIN_TOKEN=TOKEN,
            GRAPHCACHE_LOG_LEVEL="warning",
            GRAPHCACHE_MAX_NUM_SEQS=str(args.max_num_seqs),
            GRAPHCACHE_NUM_KV_BLOCKS=str(args.num_kv_blocks),
            GRAPHCACHE_ENFORCE_EAGER="true" if eager else "false",
            GRAPHCACHE_SOAK_FAIL_CAPTURES=str(self.fail_file),
            GRAPHCACHE_SOAK_STATS=str(self.stats_file),
            GRAPHCACHE_TRUST_REQUEST_CHAT_TEMPLATE="true",
            GRAPHCACHE_CHAT_TEMPLATE_TIMEOUT_S=str(TEMPLATE_TIMEOUT_S),
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "service"), os.environ.get("PYTHONPATH")])),
        )
        if args.model:
            env["GRAPHCACHE_MODEL"] = str(args.model)
        if args.cache_dir:
            env["GRAPHCACHE_CACHE_DIR"] = str(args.cache_dir)
        self.log = (Path(args.log_dir) / f"soak_{name}_server.log").open("w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "failpoint_serve.py")],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 600) -> float:
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"server {self.name} exited early (rc={self.proc.returncode}); see {self.log.name}"
                )
            try:
                if httpx.get(self.base + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - self.t0 > timeout_s:
                raise SystemExit(f"server {self.name} not ready after {timeout_s} s")
            time.sleep(0.5)
        while not self.stats_file.exists():
            time.sleep(0.2)
        return time.perf_counter() - self.t0

    def memory(self) -> dict:
        """The server's memory samples; with the engine in its own process (the CUDA default), the two
        processes' RSS summed and the CUDA figures and injected failures from the engine's."""
        stats = json.loads(self.stats_file.read_text())
        engine = self.stats_file.with_suffix(".engine.json")
        if engine.exists():
            own = json.loads(engine.read_text())
            stats = {
                **own,
                "rss_bytes": stats["rss_bytes"] + own["rss_bytes"],
                "server_rss_bytes": stats["rss_bytes"],
            }
        return stats

    async def admin(
        self, client: httpx.AsyncClient, method: str, path: str, body: dict | None = None
    ) -> dict:
        r = await client.request(
            method, self.base + path, json=body, timeout=600, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        r.raise_for_status()
        return r.json()

    async def pool(self, client: httpx.AsyncClient) -> dict:
        info = await self.admin(client, "GET", "/admin/cache")
        return {
            "entries": info["totals"]["entries"],
            "pool_bytes": info["totals"]["pool_bytes"],
            "pinned_entries": sorted(e["descriptor"] for e in info["entries"] if e["pinned"]),
            "pinned_pool_bytes": info["totals"].get("pinned_pool_bytes"),
            "allocator_pool_bytes": info.get("allocator_pool_bytes"),
        }

    def stop(self) -> int:
        self.fail_file.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = -9
        self.log.close()
        return rc


def is_error_body(text: str) -> bool:
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and bool(err.get("message"))


async def one_request(
    client: httpx.AsyncClient, body: dict, chat: bool, leave_after: int | None
) -> tuple[str, str]:
    """(outcome, detail): finished | left | refused | lost."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    want = body["max_tokens"]
    constrained = any(field in body for field, _ in STRUCTURED)

    def right(tokens: int, finish: str | None) -> bool:
        return (tokens == want and finish == "length") or (
            constrained and finish == "stop" and 0 < tokens <= want
        )

    try:
        if not body.get("stream"):
            r = await client.post(path, json=body)
            if r.status_code != 200:
                return (
                    ("refused", str(r.status_code))
                    if is_error_body(r.text)
                    else ("lost", f"HTTP {r.status_code}")
                )
            data = r.json()
            ok = right(data["usage"]["completion_tokens"], data["choices"][0]["finish_reason"])
            return ("finished", "") if ok else ("lost", f"usage {data['usage']}")
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return (
                    ("refused", str(r.status_code))
                    if is_error_body(text)
                    else ("lost", f"HTTP {r.status_code}")
                )
            chunks, usage, finish, done = 0, None, None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return ("refused", f"stream {event['error'].get('code') or event['error'].get('type')}")
                chunks += 1
                usage = event.get("usage") or usage
                for c in event.get("choices") or []:
                    finish = c.get("finish_reason") or finish
                if leave_after is not None and chunks >= leave_after:
                    return "left", ""  # leaving the context closes the connection mid-stream
            if done and usage and right(usage["completion_tokens"], finish):
                return "finished", ""
            return "lost", f"stream done={done} usage={usage} finish={finish}"
    except (httpx.TransportError, json.JSONDecodeError, KeyError) as e:
        return "lost", f"{type(e).__name__}: {e}"[:200]


def make_body(rng: random.Random, args, long: bool = False) -> tuple[dict, bool]:
    chat = rng.random() < 0.4
    stream = rng.random() < 0.6
    max_tokens = rng.randint(args.max_tokens // 2, args.max_tokens * 2 if long else args.max_tokens)
    n = rng.randint(args.prompt_max // 2, args.prompt_max) if long else rng.randint(4, args.prompt_max)
    body: dict = {
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.7]),
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < args.structured_share:
        field, value = BOMB if rng.random() < 0.05 else rng.choice(STRUCTURED)
        if field != "response_format" or chat:
            body[field] = value
    if chat and rng.random() < args.template_share:
        body["chat_template"] = rng.choice(HOSTILE_TEMPLATES if rng.random() < 0.05 else TEMPLATES)
    if chat:
        body["messages"] = [
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(max(1, n // 2)))}
        ]
    else:
        body["prompt"] = [rng.randint(10, 250) for _ in range(n)]
    return body, chat


async def client_loop(i: int, args, base: str, deadline: float, tally: Counter, details: Counter) -> None:
    rng = random.Random(1000 + i)
    async with httpx.AsyncClient(base_url=base, timeout=args.request_timeout) as client:
        while time.monotonic() < deadline:
            body, chat = make_body(rng, args)
            leave = rng.randint(1, 4) if body["stream"] and rng.random() < 0.15 else None
            outcome, detail = await one_request(client, body, chat, leave)
            tally["sent"] += 1
            tally[outcome] += 1
            if detail:
                details[f"{outcome}: {detail}"] += 1


async def bursts(args, base: str, deadline: float, tally: Counter, details: Counter) -> int:
    rng, n = random.Random(7), 0
    async with httpx.AsyncClient(base_url=base, timeout=args.request_timeout) as client:
        while time.monotonic() + args.burst_period < deadline:
            await asyncio.sleep(args.burst_period)
            reqs = [make_body(rng, args, long=True) for _ in range(args.burst_size)]
            # One that can never fit the whole KV cache: must be a clean 400 at once, not a hang.
            reqs.append(
                (
                    {
                        "prompt": [rng.randint(10, 250) for _ in range(args.num_kv_blocks * 16 + 16)],
                        "max_tokens": 8,
                        "ignore_eos": True,
                    },
                    False,
                )
            )
            for outcome, detail in await asyncio.gather(*(one_request(client, b, c, None) for b, c in reqs)):
                tally["sent"] += 1
                tally[outcome] += 1
                if detail:
                    details[f"burst {outcome}: {detail}"] += 1
            n += 1
    return n


async def admin_cycles(args, server: Server, deadline: float, baseline: dict) -> list[dict]:
    cycles = []
    async with httpx.AsyncClient() as client:
        while time.monotonic() + args.admin_period < deadline:
            server.fail_file.touch()  # captures fail from now: steps run eagerly
            await asyncio.sleep(args.admin_period / 2)
            # Cleared while still armed: no capture can refill the cache before it is measured.
            await server.admin(client, "POST", "/admin/clear")
            cleared = await server.pool(client)
            server.fail_file.unlink(missing_ok=True)
            await asyncio.sleep(args.admin_period / 2)
            warm = await server.admin(client, "POST", "/admin/warmup", {})
            # Serving goes on, so shapes captured on demand may sit next to the warmup's: the pinned
            # (warmup) entries must equal the startup baseline's, and their pool must not exceed it. It
            # can come out a segment smaller (22 vs 24 MiB on the H200): a warmup interleaved with
            # serving steps rounds the pool's segments differently. The quiet final check is exact.
            rewarmed = await server.pool(client)
            cycles.append(
                {
                    "cleared": cleared,
                    "rewarmed": rewarmed,
                    "warmup_failed": warm.get("failed"),
                    "back_to_baseline": cleared["pool_bytes"] == 0
                    and cleared["entries"] == 0
                    and rewarmed["pinned_entries"] == baseline["pinned_entries"]
                    and rewarmed["pinned_pool_bytes"] <= baseline["pinned_pool_bytes"],
                }
            )
    return cycles


async def probes(base: str, max_tokens: int) -> list[str]:
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        for p in PROBES:  # one at a time: the same batch shape on both servers
            r = await client.post(
                "/v1/completions",
                json={"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            )
            r.raise_for_status()
            out.append(r.json()["choices"][0]["text"])
    return out


async def soak(args, server: Server) -> dict:
    res: dict = {}
    async with httpx.AsyncClient() as client:
        res["baseline_pool"] = baseline = await server.pool(client)
        res["memory_start"] = server.memory()
        res["probes_start"] = await probes(server.base, args.probe_tokens)
        tally, details = Counter(), Counter()
        t0 = time.monotonic()
        deadline = t0 + args.duration
        early_at = min(60.0, args.duration / 5)

        res["memory_timeline"] = []

        async def sample_early() -> None:  # the first-minute level, then a timeline every 10 s
            await asyncio.sleep(early_at)
            res["memory_first_minute"] = server.memory()
            while time.monotonic() + 10 < deadline:
                await asyncio.sleep(10)
                res["memory_timeline"].append(server.memory())

        gathered = await asyncio.gather(
            *(client_loop(i, args, server.base, deadline, tally, details) for i in range(args.clients)),
            bursts(args, server.base, deadline, tally, details),
            admin_cycles(args, server, deadline, baseline),
            sample_early(),
        )
        res["load_seconds"] = time.monotonic() - t0
        res["bursts"], res["admin_cycles"] = gathered[-3], gathered[-2]
        res["requests"] = dict(tally)
        res["details"] = dict(details.most_common(20))
        await asyncio.sleep(2.0)  # let the engine finish aborted requests
        metrics = (await client.get(server.base + "/metrics")).text
        res["metrics"] = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith(
                (
                    "graphcache_num_preemptions_total",
                    "graphcache_graph_capture_failures",
                    "graphcache_kv_cache_usage_ratio",
                    "graphcache_num_requests_running",
                )
            )
        }
        await server.admin(client, "POST", "/admin/clear")
        res["final_cleared_pool"] = await server.pool(client)
        await server.admin(client, "POST", "/admin/warmup", {})
        res["final_pool"] = await server.pool(client)
        res["probes_end"] = await probes(server.base, args.probe_tokens)
        await asyncio.sleep(1.5)  # one more memory sample after the final clear + warmup
        res["memory_end"] = server.memory()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: the embedded tiny model)")
    ap.add_argument(
        "--make-qwen05b", type=Path, metavar="DIR", help="write (once) and use a Qwen2.5-0.5B-shaped model"
    )
    ap.add_argument("--cache-dir", type=Path, help="GRAPHCACHE_CACHE_DIR for the servers")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--clients", type=int, help="closed-loop clients (default 48 on CUDA, 6 on the CPU)")
    ap.add_argument("--max-tokens", type=int, help="output tokens per request (default 128 CUDA, 16 CPU)")
    ap.add_argument("--prompt-max", type=int, help="longest prompt in tokens (default 1024 CUDA, 96 CPU)")
    ap.add_argument("--num-kv-blocks", type=int, help="KV blocks of 16 tokens (default 2048 CUDA, 32 CPU)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--admin-period", type=float, help="seconds per fail/clear/warmup cycle (default 30 CUDA, 10 CPU)"
    )
    ap.add_argument("--burst-period", type=float, help="seconds between KV bursts (default 45 CUDA, 8 CPU)")
    ap.add_argument("--burst-size", type=int, help="long requests per burst (default 48 CUDA, 8 CPU)")
    ap.add_argument("--probe-tokens", type=int, default=24)
    ap.add_argument(
        "--structured-share",
        type=float,
        default=0.2,
        help="share of requests with an output constraint (a few of them regex bombs); 0 = none",
    )
    ap.add_argument(
        "--template-share",
        type=float,
        default=0.2,
        help="share of chats with their own chat_template (a few of them hostile); 0 = none",
    )
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--rss-margin", type=float, default=0.10, help="allowed RSS growth over the first minute")
    ap.add_argument(
        "--rss-slack-mib", type=float, default=64, help="allowed RSS growth on top of --rss-margin"
    )
    ap.add_argument("--out", type=Path, default=Path("soak.json"))
    ap.add_argument("--commit", help="the commit to report (default: git rev-parse HEAD here)")
    ap.add_argument("--log-dir", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    for name, gpu, cpu in [
        ("clients", 48, 6),
        ("max_tokens", 128, 16),
        ("prompt_max", 1024, 96),
        ("num_kv_blocks", 2048, 32),
        ("admin_period", 30.0, 10.0),
        ("burst_period", 45.0, 8.0),
        ("burst_size", 48, 8),
    ]:
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    if args.make_qwen05b:
        from benchmarks.offline_throughput import make_qwen05b

        exists = (args.make_qwen05b / "config.json").exists()
        args.model = args.model or (args.make_qwen05b if exists else make_qwen05b(args.make_qwen05b))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    try:  # --commit: a copy of the tree (the device tool's) may carry a stale .git
        result["commit"] = (
            args.commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or None
        )
    except OSError:
        result["commit"] = None
    a = Server(args, "graphs", eager=False)
    try:
        result["ready_s"] = a.wait_ready()
        result.update(asyncio.run(soak(args, a)))
    finally:
        result["sigterm_rc"] = a.stop()
    b = Server(args, "eager", eager=True)
    try:
        b.wait_ready()
        result["probes_eager"] = asyncio.run(probes(b.base, args.probe_tokens))
    finally:
        result["eager_sigterm_rc"] = b.stop()
    return report(args, result, cuda)


def report(args, r: dict, cuda: bool) -> int:
    req = Counter(r["requests"])
    m0, m1, m2 = r["memory_start"], r.get("memory_first_minute", r["memory_start"]), r["memory_end"]
    # The reference is the higher of start and first minute (allocator pools and caches fill early).
    rss_ref = max(m0["rss_bytes"], m1["rss_bytes"])
    rss_ok = m2["rss_bytes"] <= rss_ref * (1 + args.rss_margin) + args.rss_slack_mib * 2**20
    cuda_ok = m2["cuda_allocated_bytes"] <= m0["cuda_allocated_bytes"] + 64 * 2**20
    cycles_ok = all(c["back_to_baseline"] for c in r["admin_cycles"])
    final_ok = (
        r["final_cleared_pool"]["pool_bytes"] == 0
        and r["final_cleared_pool"]["entries"] == 0
        and r["final_pool"]["pool_bytes"] == r["baseline_pool"]["pool_bytes"]
        and r["final_pool"]["pinned_entries"] == r["baseline_pool"]["pinned_entries"]
    )
    probes_ok = r["probes_start"] == r["probes_end"] == r["probes_eager"]
    preempted = r["metrics"].get("graphcache_num_preemptions_total", 0)
    failures = sum(
        v for k, v in r["metrics"].items() if k.startswith("graphcache_graph_capture_failures_total")
    )
    checks = {
        "lost == 0": req["lost"] == 0,
        "pool back to baseline after every clear + warmup": cycles_ok,
        "final clear -> 0, warmup -> baseline": final_ok,
        "RSS within margin of max(start, first minute)": rss_ok,
        "every never-fitting request refused cleanly": req["refused"] >= r["bursts"],
        "cuda allocated within 64 MiB of start": cuda_ok,
        "greedy probes equal (start, end, eager)": probes_ok,
        "SIGTERM exit 0": r["sigterm_rc"] == 0,
        "KV exhausted (preemptions > 0)": preempted > 0,
        "capture failures injected": failures > 0,
    }
    mib = 2**20
    print(f"\nsoak {r['load_seconds']:.0f} s on {r['device']}, commit {r.get('commit')}, {r['date']}")
    print(
        "| requests sent | finished | left (disconnect) | refused | lost | KV bursts | admin cycles | preemptions "
        "| capture failures |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {req['sent']} | {req['finished']} | {req['left']} | {req['refused']} | {req['lost']} | {r['bursts']} "
        f"| {len(r['admin_cycles'])} | {preempted:.0f} | {failures:.0f} |"
    )
    print("\n| memory | start | first minute | end (after final clear + warmup) |")
    print("|---|---|---|---|")
    for key in ("rss_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes"):
        print(
            f"| {key.removesuffix('_bytes')} MiB | {m0[key] / mib:.1f} | {m1[key] / mib:.1f} | {m2[key] / mib:.1f} |"
        )
    print(
        f"\nengine in its own process: {'yes' if 'server_rss_bytes' in m0 else 'no'} (rss = the processes' sum)"
    )
    print(
        f"graph pool: baseline {r['baseline_pool']['pool_bytes'] / mib:.1f} MiB "
        f"({r['baseline_pool']['entries']} entries); final clear {r['final_cleared_pool']['pool_bytes']} B; "
        f"after warmup {r['final_pool']['pool_bytes'] / mib:.1f} MiB"
    )
    if r["details"]:
        print("details:", json.dumps(r["details"], indent=1))
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    r["checks"] = checks
    args.out.write_text(json.dumps(r, indent=2, default=str))
    passed = all(checks.values())
    print("SOAK", "PASSED" if passed else "FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

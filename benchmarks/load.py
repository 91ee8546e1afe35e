"""Bounded load generator for an OpenAI-compatible server (graphcache, or anything speaking its API).

N concurrent clients, each sending one request after another (closed loop), for a fixed duration or a
fixed request count. Clients mix streaming and non-streaming calls to /v1/completions and
/v1/chat/completions. Every request asks for `ignore_eos` and a fixed `max_tokens`, so the right answer
is known in advance: exactly `max_tokens` completion tokens and finish_reason "length". A request that
ends any other way counts as an error, so "errors = 0" means nothing was lost, not just "no 5xx".

Reported: throughput (requests/s, output tokens/s), time to first token and time per output token
(p50/p99, streaming requests only: a non-streaming response has no first token to time), end-to-end
latency, and errors by kind.

CLI (the lead runs this against the H200):
    python benchmarks/load.py --url http://127.0.0.1:8000 --concurrency 32 --duration 30 \
        --max-tokens 64 --out file.json

Library (the reliability tests use it):
    report = await run_load(LoadConfig(url=..., concurrency=8, duration_s=10))
    assert report.num_errors == 0, report.error_summary()

Everything is bounded: per-request timeouts, and the run as a whole is cut off at
duration + request timeout, so a hung server fails the run instead of hanging it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

# Varied lengths so prefill batches mix with decodes; plain ASCII so every tokenizer can take them.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "The quick brown fox",
    "Once upon a time, in a city built on graphs,",
    "A cache that forgets nothing is",
    "Explain, in one long sentence, why the batch was padded to the next capture size:",
    "hello",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
    "The server kept serving while the operator cleared every captured graph, and then",
    "Q: What is a KV block? A:",
)

Mode = Literal["stream", "nonstream", "mixed"]
Api = Literal["completions", "chat", "mixed"]


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    concurrency: int = 8
    # Stop starting new requests after duration_s, or after num_requests in total; at least one is needed.
    duration_s: float | None = 10.0
    num_requests: int | None = None
    max_tokens: int = 32
    mode: Mode = "mixed"
    api: Api = "mixed"
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    model: str | None = None  # None: the first id of GET /v1/models
    temperature: float = 0.0
    ignore_eos: bool = True  # makes the expected token count exact
    request_timeout_s: float = 60.0
    headers: dict[str, str] = field(default_factory=dict)

    def client_kind(self, client_index: int) -> tuple[bool, str]:
        """(streaming, api) of one client; mixed spreads the four combinations evenly over clients."""
        streaming = {"stream": True, "nonstream": False}.get(self.mode, client_index % 2 == 0)
        api = self.api if self.api != "mixed" else ("chat" if (client_index // 2) % 2 else "completions")
        return streaming, api


@dataclass
class RequestResult:
    client: int
    prompt_index: int
    api: str
    stream: bool
    ok: bool = False
    status: int | None = None
    error_kind: str | None = None  # http_<status>, timeout, transport, protocol, token_count, finish_reason
    error: str | None = None
    start_s: float = 0.0  # since the run started
    latency_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0-100); None for no values. No numpy, so the script runs anywhere."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _stats(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


@dataclass
class LoadReport:
    config: dict[str, Any]
    wall_s: float
    results: list[RequestResult]

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def errors(self) -> list[RequestResult]:
        return [r for r in self.results if not r.ok]

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def error_summary(self, limit: int = 5) -> str:
        kinds = Counter(r.error_kind for r in self.errors)
        examples = "; ".join(f"[{r.error_kind}] {r.error}" for r in self.errors[:limit])
        return f"{self.num_errors} errors of {len(self.results)} requests {dict(kinds)}: {examples}"

    def summary(self) -> dict[str, Any]:
        done = self.completed
        streamed = [r for r in done if r.stream]
        output_tokens = sum(r.completion_tokens or 0 for r in done)
        wall = max(self.wall_s, 1e-9)
        return {
            "requests": len(self.results),
            "completed": len(done),
            "errors": self.num_errors,
            "errors_by_kind": dict(Counter(r.error_kind for r in self.errors)),
            "error_examples": [f"[{r.error_kind}] {r.error}" for r in self.errors[:10]],
            "wall_s": self.wall_s,
            "throughput_req_s": len(done) / wall,
            "output_tokens": output_tokens,
            "output_tok_s": output_tokens / wall,
            "streaming_requests": len(streamed),
            "ttft_s": _stats([r.ttft_s for r in streamed if r.ttft_s is not None]),
            "tpot_s": _stats([r.tpot_s for r in streamed if r.tpot_s is not None]),
            "e2e_latency_s": _stats([r.latency_s for r in done if r.latency_s is not None]),
        }

    def to_dict(self, include_requests: bool = False) -> dict[str, Any]:
        out = {"config": self.config, "summary": self.summary()}
        if include_requests:
            out["requests"] = [asdict(r) for r in self.results]
        return out


def build_request(config: LoadConfig, model: str, api: str, stream: bool, prompt: str) -> tuple[str, dict]:
    """(path, JSON body) of one request; `ignore_eos` is the vLLM-style extension graphcache accepts."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "stream": stream,
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if stream:
        # Usage arrives in a last chunk; without it a stream's token count could only be guessed from chunks.
        body["stream_options"] = {"include_usage": True}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _choice_text(choice: dict, api: str, stream: bool) -> str:
    if api == "completions":
        return choice.get("text") or ""
    part = choice.get("delta" if stream else "message") or {}
    return part.get("content") or ""


async def _read_stream(response: httpx.Response, result: RequestResult, api: str, t0: float) -> dict | None:
    """Consume SSE chunks; fill text, ttft and finish_reason; return the usage object if one came."""
    usage = None
    saw_done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, keep-alives
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            saw_done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise _ProtocolError(f"error chunk in stream: {chunk['error']}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            text = _choice_text(choice, api, stream=True)
            # The first chunk carrying text is the first token the user sees (a chat stream may open
            # with a role-only chunk, which is not a token).
            if text and result.ttft_s is None:
                result.ttft_s = time.perf_counter() - t0
            result.text += text
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
    if not saw_done:
        raise _ProtocolError("stream ended without data: [DONE]")
    return usage


class _ProtocolError(Exception):
    pass


async def one_request(
    client: httpx.AsyncClient,
    config: LoadConfig,
    model: str,
    client_index: int,
    prompt_index: int,
    run_t0: float,
) -> RequestResult:
    stream, api = config.client_kind(client_index)
    result = RequestResult(client=client_index, prompt_index=prompt_index, api=api, stream=stream)
    path, body = build_request(config, model, api, stream, config.prompts[prompt_index])
    t0 = time.perf_counter()
    result.start_s = t0 - run_t0
    try:
        # asyncio.timeout bounds the whole request, including a stream that trickles forever (httpx's
        # timeout only bounds each read).
        async with asyncio.timeout(config.request_timeout_s):
            if stream:
                async with client.stream("POST", path, json=body) as response:
                    result.status = response.status_code
                    if response.status_code != 200:
                        await response.aread()
                        raise _HTTPError(response)
                    usage = await _read_stream(response, result, api, t0)
            else:
                response = await client.post(path, json=body)
                result.status = response.status_code
                if response.status_code != 200:
                    raise _HTTPError(response)
                payload = response.json()
                choice = (payload.get("choices") or [{}])[0]
                result.text = _choice_text(choice, api, stream=False)
                result.finish_reason = choice.get("finish_reason")
                usage = payload.get("usage")
        result.latency_s = time.perf_counter() - t0
        if usage:
            result.completion_tokens = usage.get("completion_tokens")
            result.prompt_tokens = usage.get("prompt_tokens")
        _verify(result, config)
    except _HTTPError as exc:
        result.error_kind, result.error = f"http_{exc.status}", exc.detail
    except TimeoutError:
        result.error_kind, result.error = "timeout", f"no complete answer within {config.request_timeout_s}s"
    except httpx.HTTPError as exc:
        result.error_kind, result.error = "transport", f"{type(exc).__name__}: {exc}"
    except (_ProtocolError, ValueError, KeyError, TypeError) as exc:
        result.error_kind, result.error = "protocol", f"{type(exc).__name__}: {exc}"
    return result


class _HTTPError(Exception):
    def __init__(self, response: httpx.Response) -> None:
        self.status = response.status_code
        self.detail = f"HTTP {response.status_code}: {response.text[:300]}"
        super().__init__(self.detail)


def _verify(result: RequestResult, config: LoadConfig) -> None:
    """Mark the result ok only if it ended exactly as asked; else name what differed."""
    if result.completion_tokens is None:
        result.error_kind, result.error = "protocol", "no usage.completion_tokens in the response"
        return
    if config.ignore_eos:
        if result.completion_tokens != config.max_tokens:
            result.error_kind = "token_count"
            result.error = f"completion_tokens {result.completion_tokens} != max_tokens {config.max_tokens}"
            return
        if result.finish_reason != "length":
            result.error_kind = "finish_reason"
            result.error = f"finish_reason {result.finish_reason!r} != 'length'"
            return
    elif result.finish_reason not in ("length", "stop"):
        result.error_kind, result.error = "finish_reason", f"finish_reason {result.finish_reason!r}"
        return
    if result.stream and result.ttft_s is not None and result.completion_tokens > 1:
        # vLLM's definition: decode time after the first token, per remaining token.
        result.tpot_s = (result.latency_s - result.ttft_s) / (result.completion_tokens - 1)
    result.ok = True


async def resolve_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_load(config: LoadConfig, client: httpx.AsyncClient | None = None) -> LoadReport:
    """Run the load; pass `client` to reuse one (e.g. an httpx client over an in-process ASGI app)."""
    if config.duration_s is None and config.num_requests is None:
        raise ValueError("set duration_s or num_requests, or the load never stops")
    own_client = client is None
    if client is None:
        limits = httpx.Limits(
            max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency
        )
        client = httpx.AsyncClient(
            base_url=config.url,
            timeout=httpx.Timeout(config.request_timeout_s),
            limits=limits,
            headers=config.headers,
        )
    try:
        model = config.model or await resolve_model(client)
        results: list[RequestResult] = []
        started = 0
        run_t0 = time.perf_counter()
        deadline = run_t0 + config.duration_s if config.duration_s is not None else math.inf

        def take_slot() -> int | None:
            """The next request's number, or None once the run is over (single event loop: no lock)."""
            nonlocal started
            if time.perf_counter() >= deadline:
                return None
            if config.num_requests is not None and started >= config.num_requests:
                return None
            started += 1
            return started - 1

        async def client_loop(client_index: int) -> None:
            iteration = 0
            while take_slot() is not None:
                # Clients walk the prompt list from different offsets so each step mixes prompt lengths.
                prompt_index = (client_index + iteration) % len(config.prompts)
                iteration += 1
                results.append(await one_request(client, config, model, client_index, prompt_index, run_t0))

        # The run as a whole cannot outlive its last possible request by more than one request timeout.
        overall = (config.duration_s or 0) + config.request_timeout_s * (
            1 if config.num_requests is None else max(1, math.ceil(config.num_requests / config.concurrency))
        )
        tasks = [asyncio.create_task(client_loop(i)) for i in range(config.concurrency)]
        try:
            async with asyncio.timeout(overall + 5):
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        wall = time.perf_counter() - run_t0
        return LoadReport(config=_config_dict(config, model), wall_s=wall, results=results)
    finally:
        if own_client:
            await client.aclose()


def _config_dict(config: LoadConfig, model: str) -> dict[str, Any]:
    out = asdict(config)
    out["model"] = model
    out["prompts"] = len(config.prompts)
    out.pop("headers", None)  # may carry a token
    return out


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def format_summary(summary: dict[str, Any]) -> str:
    ttft, tpot, e2e = summary["ttft_s"], summary["tpot_s"], summary["e2e_latency_s"]
    return "\n".join(
        [
            f"requests    {summary['requests']} ({summary['completed']} ok, {summary['errors']} errors"
            f"{' ' + json.dumps(summary['errors_by_kind']) if summary['errors_by_kind'] else ''}) "
            f"in {summary['wall_s']:.1f} s",
            f"throughput  {summary['throughput_req_s']:.2f} req/s, {summary['output_tok_s']:.1f} output tok/s",
            f"TTFT        p50 {_fmt_ms(ttft['p50'])}  p99 {_fmt_ms(ttft['p99'])}  "
            f"({summary['streaming_requests']} streaming requests)",
            f"TPOT        p50 {_fmt_ms(tpot['p50'])}  p99 {_fmt_ms(tpot['p99'])}",
            f"latency     p50 {_fmt_ms(e2e['p50'])}  p99 {_fmt_ms(e2e['p99'])}",
            *(f"  {example}" for example in summary["error_examples"][:5]),
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="Server base URL")
    parser.add_argument("--concurrency", type=int, default=8, help="Concurrent clients")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="Seconds to keep starting requests (default 10 when --num-requests is unset)",
    )
    parser.add_argument("--num-requests", type=int, default=None, help="Stop after this many requests")
    parser.add_argument("--max-tokens", type=int, default=32, help="Completion tokens per request (exact)")
    parser.add_argument("--mode", choices=["stream", "nonstream", "mixed"], default="mixed")
    parser.add_argument("--api", choices=["completions", "chat", "mixed"], default="mixed")
    parser.add_argument("--model", default=None, help="Model id (default: first of /v1/models)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--request-timeout", type=float, default=60.0, help="Seconds per request")
    parser.add_argument("--api-key", default=None, help="Sent as Authorization: Bearer")
    parser.add_argument("--out", default=None, help="Write the JSON report here")
    parser.add_argument("--per-request", action="store_true", help="Include every request in the JSON")
    args = parser.parse_args(argv)
    if args.duration is None and args.num_requests is None:
        args.duration = 10.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = LoadConfig(
        url=args.url,
        concurrency=args.concurrency,
        duration_s=args.duration,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        mode=args.mode,
        api=args.api,
        model=args.model,
        temperature=args.temperature,
        request_timeout_s=args.request_timeout,
        headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {},
    )
    report = asyncio.run(run_load(config))
    summary = report.summary()
    print(format_summary(summary))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report.to_dict(include_requests=args.per_request), fh, indent=2)
    return 0 if report.num_errors == 0 and summary["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

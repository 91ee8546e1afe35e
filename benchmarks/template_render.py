"""What rendering a chat template in a worker process (api/server/render_pool.py) adds to a chat's latency.

Prints a table: for each template and chat size, the render in the server's own process (what the
server did before templates moved out) and the same job through a RenderPool (JSON job out, text back
over pipes), p50 and p99 over N renders, and the difference. The bar (issue 35): under 1 ms added.

    python benchmarks/template_render.py [--renders 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from graphcache.api.server.render_pool import RenderPool, encode_job
from graphcache.model.chat_template import compile_client_template, render_chat, set_text_limit
from graphcache.model.tiny import CHAT_TEMPLATE as TINY_TEMPLATE

REPO = Path(__file__).resolve().parents[1]
QWEN3 = (REPO / "tests" / "data" / "chat_templates" / "qwen3_think.jinja").read_text()
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MAX_CHARS = 32768 * 32


def _chat(turns: int, chars: int) -> list[dict]:
    text = ("The lighthouse keeper writes down every ship that passes. " * (chars // 58 + 1))[:chars]
    chat = [{"role": "system", "content": "You are helpful."}]
    for i in range(turns):
        chat.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return chat


def _quantiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return samples[len(samples) // 2] * 1e3, samples[int(len(samples) * 0.99)] * 1e3


async def _case(pool: RenderPool, template: str, chat: list[dict], tools, renders: int) -> tuple:
    variables = {"bos_token": "", "eos_token": "", "pad_token": "", "tools": tools}
    compiled = compile_client_template(template)
    set_text_limit(compiled, MAX_CHARS)
    local, pooled = [], []
    for _ in range(renders):
        t0 = time.perf_counter()
        expected = render_chat(compiled, chat, True, False, **variables)
        local.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        # The job is encoded on an input thread in the server; it is timed here as part of the path.
        got = await pool.render(encode_job(template, chat, True, False, variables, MAX_CHARS))
        pooled.append(time.perf_counter() - t0)
        assert got == expected
    return _quantiles(local), _quantiles(pooled)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--renders", type=int, default=500)
    args = parser.parse_args()
    pool = RenderPool("bench", workers=2, timeout_s=10.0, memory_mb=512)
    await pool.render(encode_job(TINY_TEMPLATE, _chat(1, 10), True, False, {}, MAX_CHARS))  # started
    cases = [
        ("tiny (ChatML)", TINY_TEMPLATE, _chat(1, 200), None),
        ("qwen3, 1 turn", QWEN3, _chat(1, 200), None),
        ("qwen3, tools, 8 turns", QWEN3, _chat(8, 500), [TOOL]),
        ("qwen3, 32 KB of chat", QWEN3, _chat(8, 4000), [TOOL]),
    ]
    print(f"{'template, chat':<26}{'in process p50/p99 ms':>24}{'worker p50/p99 ms':>22}{'added p50 ms':>15}")
    rows = []
    for name, template, chat, tools in cases:
        (lp50, lp99), (pp50, pp99) = await _case(pool, template, chat, tools, args.renders)
        rows.append({"case": name, "local_p50_ms": lp50, "worker_p50_ms": pp50, "added_p50_ms": pp50 - lp50})
        print(f"{name:<26}{lp50:>13.3f} / {lp99:<8.3f}{pp50:>11.3f} / {pp99:<8.3f}{pp50 - lp50:>13.3f}")
    await pool.close()
    print(json.dumps(rows))


if __name__ == "__main__":
    asyncio.run(main())

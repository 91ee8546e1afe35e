"""Streaming detokenization cost per output token on the CPU (model/detokenizer.py IncrementalDetokenizer).

    PYTHONPATH=service python benchmarks/detokenize_bench.py [--tokens 2000] [--repeats 7]

A 2,000-token completion (tiny checkpoint's byte-level BPE, corpus text, so multi-byte characters
split across tokens occur) after a 200-token prompt is fed to a fresh detokenizer: one id per add
(the engine's per-step path), with two stop strings (the stop-string path), and 8 ids per add (a
stream consumer catching up), once through tokenizers' DecodeStream (TokenTextStream, what a real
Tokenizer uses) and once through the hand-written sliding-window decode it replaced
(WindowTextStream). Prints the best of N interleaved runs in CPU microseconds per token: a timing
printout, not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

from graphcache.model.detokenizer import IncrementalDetokenizer  # noqa: E402
from graphcache.model.tiny import corpus_text, make_tiny_model  # noqa: E402
from graphcache.model.tokenizer import Tokenizer  # noqa: E402

MULTILINGUAL = "Привет, мир. こんにちは世界。你好 😀🚀👍🏽 ©®™ ≤≥ مرحبا\n"


class DecodeOnly:
    """The tokenizer seen only through decode(): IncrementalDetokenizer then uses the hand-written
    sliding-window decode (WindowTextStream), the code DecodeStream replaced."""

    def __init__(self, tok: Tokenizer) -> None:
        self.decode = tok.decode


def run(
    tok: Tokenizer | DecodeOnly, prompt: list[int], out: list[int], stop: list[str] | None, chunk: int
) -> tuple[float, str]:
    start = time.process_time()  # CPU time: the machine may be shared
    detok = IncrementalDetokenizer(tok, prompt, stop)
    text = "".join(detok.add(out[i : i + chunk]) for i in range(0, len(out), chunk)) + detok.finish()
    return time.process_time() - start, text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tok = Tokenizer(make_tiny_model(Path(d) / "m"))
    # Prose and code from the corpus with multilingual lines: CJK and emoji split across byte tokens.
    lines = corpus_text().splitlines(keepends=True)
    text = "".join(line + (MULTILINGUAL if n % 8 == 7 else "") for n, line in enumerate(lines * 4))
    ids = tok.encode(text, add_special_tokens=False)
    prompt, out = ids[:200], ids[200 : 200 + args.tokens]
    assert len(out) == args.tokens, "corpus too short for --tokens"
    expected = tok.decode(out)
    print(
        f"{len(out)} output tokens, {len(expected)} characters ({sum(ord(c) > 127 for c in expected)} non-ASCII); "
        f"best of {args.repeats}, CPU us/token"
    )
    impls = {"window (hand-written)": DecodeOnly(tok), "DecodeStream": tok}
    print(f"{'':28s}" + "".join(f"{name:>24s}" for name in impls))
    for name, stop, chunk in (
        ("1 id/add, no stops", None, 1),
        ("1 id/add, 2 stop strings", ["</answer>", "zzz"], 1),
        ("8 ids/add, no stops", None, 8),
    ):
        best = dict.fromkeys(impls, float("inf"))
        for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
            for impl, t in impls.items():
                seconds, streamed = run(t, prompt, out, stop, chunk)
                assert streamed == expected, f"{impl}, {name}: streamed text differs from a whole decode"
                best[impl] = min(best[impl], seconds)
        print(f"{name:28s}" + "".join(f"{best[impl] / len(out) * 1e6:24.2f}" for impl in impls))


if __name__ == "__main__":
    main()

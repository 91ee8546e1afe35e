"""Where the engine thread spends its time: cProfile of the offline workload (graph or eager mode).

    python benchmarks/profile_engine.py --make-qwen05b /tmp/qwen05b --num-seqs 128 --out profile.txt

Runs benchmarks/offline_throughput.py's workload through the real Engine with the engine thread
under cProfile (the thread that owns the GPU: model steps, scheduling, sampling, detokenizing),
and prints the top functions by cumulative and by own time. CUDA work is asynchronous, so time
shows up where the host waits for the device (e.g. the .cpu()/.tolist() of sampled tokens).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package
from graphcache.engine.loop.engine import Engine  # noqa: E402

import benchmarks.offline_throughput as ot  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="graph", choices=["graph", "eager"])
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--out", type=Path, default=Path("profile.txt"))
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="warn at each host-device sync (torch.cuda.set_sync_debug_mode)",
    )
    known, rest = ap.parse_known_args()
    args = ot.build_parser().parse_args(rest)
    if args.smoke:
        ot.apply_smoke(args)
    args.model = model = ot.resolve_model(args)
    prof = cProfile.Profile()
    original = Engine._thread_main

    def profiled(self: Engine) -> None:
        if known.sync_debug:
            import torch

            torch.cuda.set_sync_debug_mode("warn")
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()

    Engine._thread_main = profiled
    config = json.loads((model / "config.json").read_text())
    for row in ot.bench_engine(args, known.mode, ot.build_workloads(args, config["vocab_size"])):
        print(
            f"{known.mode} {row['workload']}: {row['output_tokens']} tokens in {row['seconds']:.1f}s = "
            f"{row['tokens_per_s']:.0f} tok/s, steps {row['steps_by_mode']}"
        )
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(known.top)
    stats.sort_stats("tottime").print_stats(known.top)
    known.out.write_text(buf.getvalue())
    print(buf.getvalue()[-12000:])


if __name__ == "__main__":
    main()

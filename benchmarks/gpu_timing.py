"""GPU time of a call, shared by the benchmarks: gpu_median_ms puts CUDA events around each call (what one
eager or replayed step costs); graph_us times kernels inside one CUDA graph holding many rounds of the calls,
so launch gaps inside it count as in a captured decode step (the GEMM sweeps)."""

from __future__ import annotations

import statistics

import torch


def gpu_median_ms(fn, steps: int) -> float:
    """Median GPU milliseconds of fn() (CUDA events around each call)."""
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_us(fns: list, reps: int = 20) -> float:
    """Microseconds per call from replays of a CUDA graph holding `reps` rounds of the calls fns[i]()
    (one per weight copy; no launch gaps counted)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for fn in fns:
                fn()
    g.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (reps * len(fns)))
    g.reset()
    return statistics.median(times)

"""Kernel timing inside one CUDA graph, shared by the GEMM benchmarks (fp8_bench, fp8_gemv_sweep,
bf16_gemv_sweep): a graph holds many rounds of the calls so launch gaps inside it count as in a captured
decode step, and the time is the median of 5 replays."""

from __future__ import annotations

import statistics

import torch


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

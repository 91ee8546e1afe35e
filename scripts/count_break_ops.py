"""Count the torch calls inside one eager break (paged_attention) per layer, on the CPU.

At small decode batches a graph-mode step is host-bound: every layer's eager break pays Python +
dispatcher + launch cost for each torch call it makes, every step. This script is the host-cost
proxy we can measure without a GPU: it runs a decode step through the runner (eager capture
backend, tiny model) and counts, per paged_attention call,
  - torch-function calls: what Python dispatches (torch.* functions, Tensor methods, slicing,
    property reads like .shape count too: each is a trip through the torch Python layer);
  - aten ops: what reaches the C++ dispatcher (views included; on CUDA the non-view ones launch).

--kernel flash / flash_paged / triton plan the step for the CUDA FlashAttention varlen paths or the unified
Triton kernel and stand in a no-op for the kernel (one aten call here; on the GPU it is one launch), so its host cost can be counted too.

Usage: .venv/bin/python scripts/count_break_ops.py [--decodes 8] [--ctx 40] [--prefills 0]
       [--kernel sdpa|flash|flash_paged|triton]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import graphcache.model.llama as llama  # noqa: E402
from graphcache.engine.plan import StepPlan, StepSeq
from graphcache.engine.worker.runner import ModelRunner  # noqa: E402
from helpers_model import Blocks, cpu_settings, prompt_ids, tiny_checkpoint  # noqa: E402


class _CountFunctions(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names[getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))] += 1
        return func(*args, **(kwargs or {}))


class _CountAten(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _flash_stand_in(out, *args, **kwargs):
    return torch.ops.aten.alias(out)  # one aten op in place of the kernel; computes nothing


def _unified_stand_in(q, k_cache, v_cache, out, *args, **kwargs):
    return torch.ops.aten.alias(out)  # one aten op in place of the unified kernel; computes nothing


def count(decodes: int, ctx: int, prefills: int, verbose: bool, kernel: str = "sdpa") -> dict[str, float]:
    if kernel != "sdpa":
        import graphcache.engine.worker.runner as runner_mod
        import graphcache.model.attention as attention

        runner_mod.select_attention_kernel = lambda *a: kernel
        attention._FLASH_INPLACE = _flash_stand_in
        attention.unified_attention = _unified_stand_in
    runner = ModelRunner(
        cpu_settings(
            tiny_checkpoint("qwen2"),
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            num_kv_blocks=2048,
            max_model_len=512,
        )
    )
    blocks = Blocks(runner.block_size)
    tables = [blocks.table(ctx + 1) for _ in range(decodes)]
    for i, table in enumerate(tables):  # fill each context first (uncounted)
        runner.execute(StepPlan.standalone([StepSeq(prompt_ids(ctx, seed=i), 0, table, True)]))
    seqs = [StepSeq([7], ctx, table, True) for table in tables]
    seqs += [StepSeq(prompt_ids(20, seed=100 + j), 0, blocks.table(20), True) for j in range(prefills)]

    fn_mode, aten_mode = _CountFunctions(), _CountAten()
    calls = 0
    original = llama.paged_attention

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        with fn_mode, aten_mode:
            return original(*args, **kwargs)

    llama.paged_attention = counted
    try:
        runner.execute(StepPlan.standalone(seqs))
    finally:
        llama.paged_attention = original
    if verbose:
        print("torch-function calls, all layers:", dict(fn_mode.names.most_common()))
        print("aten ops, all layers:", dict(aten_mode.names.most_common()))
    return {
        "layer_calls": calls,
        "fn_per_layer": sum(fn_mode.names.values()) / calls,
        "aten_per_layer": sum(aten_mode.names.values()) / calls,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--ctx", type=int, default=40)
    p.add_argument("--prefills", type=int, default=0)
    p.add_argument("--kernel", choices=["sdpa", "flash", "flash_paged", "triton"], default="sdpa")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args()
    r = count(a.decodes, a.ctx, a.prefills, a.verbose, a.kernel)
    print(
        f"kernel={a.kernel} decodes={a.decodes} ctx={a.ctx} prefills={a.prefills}: "
        f"{r['layer_calls']} paged_attention calls; per layer: {r['fn_per_layer']:.1f} torch-function calls, {r['aten_per_layer']:.1f} aten ops"
    )


if __name__ == "__main__":
    main()

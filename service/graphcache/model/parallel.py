"""Tensor parallelism inside one host: the process group, the shard arithmetic, the parallel layers.

Megatron's split, as vLLM, SGLang, nano-vllm and gpt-fast do it. Each of the N ranks holds:
- attention: its H/N query heads and K/N KV heads (q/k/v projections are column-parallel by head;
  so is the KV cache: a rank stores only its heads), o_proj row-parallel (input dim split), then an
  all-reduce (sum) of the partial outputs;
- MLP: gate/up column-parallel (intermediate dim split), down row-parallel, then an all-reduce;
- embedding: rows [r * Vp, (r + 1) * Vp) of the vocabulary (Vp = ceil(V / N), the last shard padded
  with zero rows); ids outside a rank's range look up zeros, and an all-reduce sums the one real row;
- LM head: the same vocabulary rows; each rank computes its [R, Vp] slice, an all-gather assembles
  [R, N * Vp] and the first V columns are the logits (every rank gets all of them; only rank 0 samples).
Norms, rotary and biases of row-parallel layers are replicated (the bias is added once, after the
reduce). Two all-reduces per layer, one per step for the embedding, one all-gather for the head.

`TensorParallel.single()` (size 1) takes today's exact code path: the layers are plain nn.Linear /
nn.Embedding and no collective is ever called. Collectives go through torch.distributed on the
group given, gloo on the CPU, NCCL on CUDA (capturable: they live inside the graph segments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from graphcache.model.config import ModelConfig, ModelLoadError

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "TensorParallel",
    "VocabParallelEmbedding",
    "check_shardable",
    "column_linear",
    "row_linear",
    "shard_range",
    "vocab_shard",
]


@dataclass(frozen=True)
class TensorParallel:
    """Which shard this process holds: rank of size, and the group the collectives run on."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None = the default group (or no group at size 1)

    @classmethod
    def single(cls) -> TensorParallel:
        return cls()

    @classmethod
    def from_group(cls, group: Any = None) -> TensorParallel:
        """This process's place in `group` (default: the initialized default group)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "tensor parallelism needs torch.distributed initialized first "
                "(torch.distributed.init_process_group(backend='nccl' or 'gloo', ...))"
            )
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (x is returned)."""
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        if x.device.type == "cuda":  # one NCCL call, capturable
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        else:  # gloo has the list form only
            dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.group)
        return out


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's even share of `total` (the caller checked divisibility)."""
    per = total // size
    return rank * per, (rank + 1) * per


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, real rows, padded rows Vp) of rank's vocabulary shard: Vp = ceil(V / size); the last
    shards may hold fewer real rows (or none), the rest of their Vp rows are zero padding."""
    per = -(-vocab_size // size)
    start = min(rank * per, vocab_size)
    return start, min(per, vocab_size - start), per


def check_shardable(config: ModelConfig, size: int) -> None:
    """ModelLoadError naming the fix when the model cannot be split `size` ways by heads."""
    if size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be >= 1, got {size}")
    for what, n in (
        ("num_attention_heads", config.num_heads),
        ("num_key_value_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size),
        # 0 (divisible) for a dense model; the CLI's preflight passes a dense shape without the field
        ("moe_intermediate_size", getattr(config, "moe_intermediate_size", 0)),
    ):
        if n % size:
            raise ModelLoadError(
                f"tensor_parallel_size {size} does not divide the model's {what} ({n}): every rank must hold "
                f"whole heads (and KV heads: a rank's KV cache stores only its own); set tensor_parallel_size "
                f"to a divisor of {n}"
            )


class ColumnParallelLinear(nn.Linear):
    """y[:, shard] = x @ W[shard].T (+ b[shard]): this rank's rows of the output; no communication."""

    def __init__(self, in_features: int, out_features_per_rank: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features_per_rank, bias=bias)
        self.tp = tp


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x[:, shard] @ W[:, shard].T, then + b (replicated, added once after the sum)."""

    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features_per_rank, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / N] -> [T, out]
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's vocabulary rows [start, start + Vp); other ids look up zeros, an all-reduce sums."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        self.vocab_start, self.vocab_rows, per = vocab_shard(vocab_size, tp.rank, tp.size)
        super().__init__(per, dim)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, dim]
        h.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)


class ParallelLMHead(nn.Module):
    """The LM head over this rank's vocabulary rows: weight [Vp, hidden], the same split as the embedding
    (so tied weights stay tied shard by shard)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        _, _, per = vocab_shard(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(per, hidden))
        self.tp = tp

    def logits_into(self, h: torch.Tensor, out: torch.Tensor) -> None:
        # h [R, hidden] -> out [R, V] (written in place), every rank.
        local = torch.mm(h, self.weight.t())  # [R, Vp]
        parts = self.tp.all_gather(local)  # [N, R, Vp]
        full = parts.permute(1, 0, 2).reshape(h.shape[0], -1)  # [R, N * Vp], vocab order
        out.copy_(full[:, : self.vocab_size])


# --- builders the decoder uses: plain layers at size 1 (today's exact path), parallel ones above --------


def column_linear(in_features: int, out_per_rank: int, bias: bool, tp: TensorParallel) -> nn.Linear:
    if not tp.enabled:
        return nn.Linear(in_features, out_per_rank, bias=bias)
    return ColumnParallelLinear(in_features, out_per_rank, bias, tp)


def row_linear(in_per_rank: int, out_features: int, bias: bool, tp: TensorParallel) -> nn.Linear:
    if not tp.enabled:
        return nn.Linear(in_per_rank, out_features, bias=bias)
    return RowParallelLinear(in_per_rank, out_features, bias, tp)

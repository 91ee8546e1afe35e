"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral: a router and E gated-SiLU experts.

Each token's router logits (a [E, H] linear, no bias) pick its top-k experts; their outputs are summed,
weighted by the routing probabilities:
  probs = softmax(logits) over all E (fp32); weights, ids = top-k of probs; renormalized to sum 1 when
  norm_topk_prob (Mixtral always: the same as a softmax over the k chosen logits).
Qwen3-MoE rounds the weights to the model dtype before they scale the expert outputs, Mixtral keeps
them in fp32 (as Hugging Face's modeling code does; only bf16/fp16 runs see the difference).

The expert weights are stacked at load into two parameters, [E * 2I, H] (per expert the rows gate | up,
as the dense MLP's gate_up_proj) and [E * H, I] (down), viewed [E, 2I, H] and [E, H, I] in the forward;
2-D so the loader fills an expert's rows like any fused projection. On CUDA the experts run as the
Triton grouped GEMM of moe_kernel.py (fixed shapes, no host sync: inside the captured graphs); on the
CPU a loop over the experts that holds tokens (the reference the kernel is tested against).

Tensor parallelism splits each expert's intermediate rows over the ranks like the dense MLP's (gate/up
rows, down columns), keeps the router replicated (every rank routes alike) and all-reduces the sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcache.model.config import ModelConfig
from graphcache.model.fused_ops import silu_mul
from graphcache.model.moe_kernel import fused_experts, pick_blocks
from graphcache.model.parallel import TensorParallel


def moe_kernel_variant(config: ModelConfig, num_tokens: int) -> tuple[int, ...]:
    """What the grouped-GEMM kernels compile per step size (their BLOCK_M; () for a dense model): a graph
    capture of a step whose variant has not run yet warms it up outside the capture first."""
    if not config.moe_layers:
        return ()
    return (pick_blocks(num_tokens * config.num_experts_per_tok, config.num_experts).m,)


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, weight_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in weight_dtype, ids [T, k] int64), in top-k order."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype), ids


def experts_reference(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """fused_experts in PyTorch, a loop over the experts that hold tokens (it synchronizes with the host,
    so it is the CPU path only). Same shapes and rounding: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I],
    weights/ids [T, k] -> [T, H]."""
    t, hidden = x.shape
    inter = w_gate_up.shape[1] // 2
    out = x.new_zeros((t, ids.shape[1], hidden))  # [T, k, H]: each (token, slot) written once
    for e in torch.unique(ids).tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = silu_mul(x[tokens] @ w_gate_up[e].t(), inter, fused=False)  # [n, I]
        y = h @ w_down[e].t()  # [n, H]
        out[tokens, slots] = (y * weights[tokens, slots, None]).to(x.dtype)
    return out.sum(1, dtype=torch.float32).to(x.dtype)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.inter = config.moe_intermediate_size // tp.size  # this rank's share of each expert
        self.hidden = config.hidden_size
        self.renormalize = config.norm_topk_prob
        # Qwen3-MoE scales by weights rounded to the model dtype; Mixtral by fp32 ones (see the module doc).
        self.round_weights = config.architecture == "qwen3_moe"
        # A plain parameter, not an nn.Linear: the router stays in the model dtype whatever replaces Linears.
        self.router = nn.Parameter(torch.empty(self.num_experts, self.hidden))  # [E, H]
        self.experts_gate_up = nn.Parameter(torch.empty(self.num_experts * 2 * self.inter, self.hidden))
        self.experts_down = nn.Parameter(torch.empty(self.num_experts * self.hidden, self.inter))

    def inactive_params(self) -> int:
        """Expert weights a token does not run through (all but its top-k experts')."""
        per_expert = (self.experts_gate_up.numel() + self.experts_down.numel()) // self.num_experts
        return (self.num_experts - self.top_k) * per_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        logits = F.linear(x, self.router)  # [T, E] in the model dtype, like HF
        weights, ids = route(
            logits, self.top_k, self.renormalize, x.dtype if self.round_weights else torch.float32
        )
        w_gate_up = self.experts_gate_up.view(self.num_experts, 2 * self.inter, self.hidden)  # [E, 2I, H]
        w_down = self.experts_down.view(self.num_experts, self.hidden, self.inter)  # [E, H, I]
        if x.is_cuda:
            out = fused_experts(x, w_gate_up, w_down, weights, ids)
        else:
            out = experts_reference(x, w_gate_up, w_down, weights, ids)
        return self.tp.all_reduce(out)  # [T, hidden]: the partial sums of this rank's expert rows

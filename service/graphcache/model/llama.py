"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3; Qwen3-MoE and Mixtral with the sparse
MLP of moe.py) over a flat token layout.

No batch dimension: all sequences' tokens of a step are concatenated, T tokens in all, and the
paged attention op (attention.py) splits them per request from the per-step metadata. Every
tensor argument of forward() is a static buffer of the runner, so the whole forward can be
captured as a breakable CUDA graph with attention as the eager break. The KV-cache write is part of
the graph segment (index_copy_ by the static slot_mapping), not of the break: at replay it costs
no host time. Math follows Hugging Face transformers' modeling code so logits match it (the CPU
tests check that).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from graphcache.model import bf16_gemv
from graphcache.model.attention import graph_attention, paged_attention
from graphcache.model.config import ModelConfig
from graphcache.model.forward_context import current_forward_context
from graphcache.model.fp8_linear import Fp8Linear
from graphcache.model.fp8_rope import RopeArgs
from graphcache.model.fused_ops import add_rmsnorm, rotary_cache_, silu_mul
from graphcache.model.lora_layers import LoraStack
from graphcache.model.moe import SparseMoE
from graphcache.model.parallel import (
    ParallelLMHead,
    TensorParallel,
    VocabParallelEmbedding,
    check_shardable,
    column_linear,
    row_linear,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        # Like HF: normalize in fp32, cast back, then scale (order matters for bf16 parity).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool):
        """(norm(x + residual), x + residual): [T, dim] each; residual None = x alone (first layer)."""
        return add_rmsnorm(x, residual, self.weight, self.eps, fused)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with linear or llama3 scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary(nn.Module):
    """Precomputed cos/sin for every position up to max_positions (a gather per step, no trig)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        # Filled by build(); non-persistent: derived from the config, never in a checkpoint.
        self.register_buffer("cos", torch.empty(max_positions, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, config.head_dim), persistent=False)

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.config)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2], fp32 like HF
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D] (rotate-half layout)
        self.cos = emb.cos().to(device=device, dtype=dtype)  # cast like HF casts cos to x.dtype
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def forward(self, positions, q, k, v, slot_mapping, k_slots, v_slots, fused: bool = False):
        """positions [T]; q [T, H, D]; k, v [T, K, D]: q and k rotated, then k and v written to their
        cache slots (k_slots, v_slots [num_slots, K, D] at slot_mapping [T]); fused: all of it one kernel,
        in place (fused_ops.rotary_cache_). Returns (q, k) rotated."""
        return rotary_cache_(q, k, v, self.cos, self.sin, positions, slot_mapping, k_slots, v_slots, fused)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: Rotary, tp: TensorParallel) -> None:
        super().__init__()
        # This rank's heads (all of them at tp size 1): q/k/v split by head, o_proj by its input.
        self.num_heads, self.num_kv_heads = config.num_heads // tp.size, config.num_kv_heads // tp.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # One matmul for q, k and v: rows [q | k | v] (the loader fills the slices).
        self.qkv_proj = column_linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, tp)
        self.o_proj = row_linear(self.q_size, config.hidden_size, config.o_bias, tp)  # all-reduce at tp > 1
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # Qwen3: per-head RMSNorm over head_dim, before rotary
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.fused = False  # fused_ops kernels (LlamaModel.use_fused_ops)
        self.small_gemm = False  # bf16_gemv at 1-64 rows (LlamaModel.use_small_gemm)
        # Bound by the runner (bind_kv_cache): [2, num_slots, K, D] = k, v caches as flat slots,
        # plus the k and v halves as views made once here, not per step.
        self.kv_cache: torch.Tensor | None = None
        self.k_slots: torch.Tensor | None = None  # [num_slots, K, D]
        self.v_slots: torch.Tensor | None = None
        self.k_blocks: torch.Tensor | None = None  # [num_blocks, block_size, K, D] (paged kernels)
        self.v_blocks: torch.Tensor | None = None
        # LoRA adapters of qkv_proj and o_proj (engine/worker/lora_slots.py attach_lora); None: not served
        self.lora_qkv: LoraStack | None = None
        self.lora_o: LoraStack | None = None

    def forward(
        self, positions: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        # positions [T], slot_mapping [T] (cache slot of each token; padded tokens: a scratch slot), x [T, hidden];
        # residual [T, hidden]: the stream this output is added to at the next norm (o_proj's LoRA adds there)
        t = x.shape[0]
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: call LlamaModel.bind_kv_cache() (the runner does)")
        rope = self._rope_in_gemm(positions, slot_mapping, x)
        # [T, (H + 2K) * D]; with rope, q and k come rotated and k, v are already in the cache
        # (rope is None unless qkv_proj is an Fp8Linear: _rope_in_gemm checked)
        # LoRA's shrink before the base GEMM (beside it in a graph), its expand after (never with rope in
        # the GEMM: LoRA is refused with FP8, the runner)
        lora = self.lora_qkv.shrink_(x) if self.lora_qkv is not None else None
        if rope is None:
            qkv = bf16_gemv.linear(self.qkv_proj, x, self.small_gemm)
        else:
            qkv = cast(Fp8Linear, self.qkv_proj).qkv_rope_forward(x, rope)
        if lora is not None:
            lora.add_to(qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, K, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, K, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # Rotary, then the KV write (one kernel when fused), here in the graph segment, over all T
        # (padded) rows: capturable because slot_mapping is a static buffer, and free on the host at
        # replay. Padded rows all land on the runner's scratch slot, which no sequence owns and
        # attention never reads.
        if rope is None:
            q, k = self.rotary(positions, q, k, v, slot_mapping, self.k_slots, self.v_slots, self.fused)
        # Allocated inside the graph segment, so its address is fixed for every replay; the eager
        # break writes its real rows and returns nothing. Padded rows stay uninitialized: they are
        # row-independent all the way to the (unread) padded logits, see attention.py.
        out = torch.empty_like(q)  # [T, H, D]
        ctx = current_forward_context()
        if ctx.mode == "full":
            # Full runtime mode (uniform decode, or a mixed step on the unified kernel): the kernel reads
            # lengths, starts and block tables from static device buffers, so it is recorded inside the graph.
            assert self.k_blocks is not None and self.v_blocks is not None  # bound with kv_cache
            graph_attention(q, out, self.k_blocks, self.v_blocks, ctx.attention, self.scale)
        else:
            paged_attention(q, k, v, out, self.kv_cache, self.k_blocks, self.v_blocks, self.scale)
        attended = out.view(t, self.q_size)  # [T, H * D]
        beside = self.lora_o.add_beside_(attended, residual) if self.lora_o is not None else None
        y = bf16_gemv.linear(self.o_proj, attended, self.small_gemm)  # [T, hidden]
        if beside is not None:
            beside.join()
        return y

    def _rope_in_gemm(
        self, positions: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor
    ) -> RopeArgs | None:
        """RopeArgs when the FP8 qkv GEMM also rotates and writes the cache (one token, fused ops on, no
        q/k norm between the two), else None. Depends on shapes and flags only: fixed for a captured graph."""
        qkv = self.qkv_proj
        if x.shape[0] != 1 or not self.fused or self.qk_norm or not isinstance(qkv, Fp8Linear):
            return None
        assert self.k_slots is not None and self.v_slots is not None
        rope = RopeArgs(
            positions, self.rotary.cos, self.rotary.sin, slot_mapping, self.k_slots, self.v_slots,
            self.num_heads, self.num_kv_heads, self.head_dim,
        )  # fmt: skip
        return rope if qkv.folds_rope(x, rope) else None


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.inter = config.intermediate_size // tp.size  # this rank's share
        self.gate_up_proj = column_linear(config.hidden_size, 2 * self.inter, False, tp)  # rows [gate | up]
        self.down_proj = row_linear(self.inter, config.hidden_size, False, tp)  # all-reduce at tp > 1
        self.fused = False
        self.small_gemm = False  # bf16_gemv at 1-64 rows (LlamaModel.use_small_gemm)
        # LoRA adapters of gate_up_proj and down_proj (engine/worker/lora_slots.py attach_lora); None: not served
        self.lora_gate_up: LoraStack | None = None
        self.lora_down: LoraStack | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """residual [T, hidden]: the stream the output is added to at the next norm (down_proj's LoRA adds
        there)."""
        if isinstance(self.gate_up_proj, Fp8Linear):  # decode sizes: the activation in the GEMM's epilogue
            return self.down_proj(self.gate_up_proj.silu_mul_forward(x, self.inter))
        lora_gate_up, lora_down = self.lora_gate_up, self.lora_down
        if lora_gate_up is None or lora_down is None or not lora_gate_up.index.active:  # no adapter row
            if bf16_gemv.takes(self.gate_up_proj, x, self.small_gemm):  # silu * up in the GEMM's epilogue
                h = bf16_gemv.small_silu_mul(x, self.gate_up_proj.weight)  # [T, I]
                return bf16_gemv.linear(self.down_proj, h, self.small_gemm)
            return self.down_proj(
                silu_mul(self.gate_up_proj(x), self.inter, self.fused)
            )  # via [T, 2I] -> [T, I]
        if lora_gate_up.forks(x):  # the whole delta beside the GEMM, added by the activation
            delta = x.new_empty(x.shape[0], 2 * self.inter)  # [T, 2I]
            beside = lora_gate_up.add_beside_(x, delta, zero_first=True)
            gate_up = bf16_gemv.linear(self.gate_up_proj, x, self.small_gemm)  # [T, 2I]
            if beside is not None:
                beside.join()
            h = silu_mul(gate_up, self.inter, self.fused, delta)  # [T, I]
        else:
            lora = lora_gate_up.shrink_(x)  # before the base GEMM
            gate_up = bf16_gemv.linear(self.gate_up_proj, x, self.small_gemm)
            if lora is not None:
                lora.add_to(gate_up)
            h = silu_mul(gate_up, self.inter, self.fused)
        beside = lora_down.add_beside_(h, residual)
        y = bf16_gemv.linear(self.down_proj, h, self.small_gemm)  # [T, hidden]
        if beside is not None:
            beside.join()
        return y


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: Rotary, tp: TensorParallel, index: int = 0) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, rotary, tp)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(config, tp) if index in config.moe_layers else MLP(config, tp)
        self.fused = False

    def forward(
        self,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embeddings for the first, residual None); returns this
        layer's output and the residual stream before it, added at the next norm (one fused kernel)."""
        h, residual = self.input_norm.add_forward(x, residual, self.fused)  # residual = x + residual
        h = self.attn(positions, slot_mapping, h, residual)
        h, residual = self.post_attn_norm.add_forward(h, residual, self.fused)
        mlp = self.mlp
        return (mlp(h, residual) if isinstance(mlp, MLP) else mlp(h)), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, *, max_positions: int | None = None, tp: TensorParallel | None = None
    ) -> None:
        """tp: this process's shard (model/parallel.py); None or size 1 = the whole model, no collectives."""
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallel.single()
        check_shardable(config, tp.size)
        self.rotary = Rotary(config, max_positions or config.max_position_embeddings)
        # At tp > 1 the vocabulary rows are split over the ranks; the head all-gathers the logits.
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            if tp.enabled
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary, tp, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused = False
        self.small_gemm = False
        self.lm_head = (
            ParallelLMHead(config.vocab_size, config.hidden_size, tp)
            if tp.enabled
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def use_fused_ops(self, on: bool) -> None:
        """Triton kernels for add+RMSNorm, rotary and SiLU*mul (fused_ops.py; CUDA): fewer, larger kernels."""
        for m in self.modules():
            if hasattr(m, "fused"):
                setattr(m, "fused", on)  # noqa: B010 (Module's __setattr__ types values as Tensor | Module)

    def use_small_gemm(self, on: bool) -> int:
        """bf16_gemv's kernel for the linear layers and the head at 1-64 rows (where it takes them: CUDA, 16-bit,
        plain nn.Linear); on: compiles its tiles now, before any graph capture. Returns the launches made."""
        for m in self.modules():
            if hasattr(m, "small_gemm"):
                setattr(m, "small_gemm", on)  # noqa: B010 (Module's __setattr__ types values as Tensor | Module)
        if not on:
            return 0
        shapes: dict[tuple[int, int, bool], torch.Tensor] = {}
        for m in self.modules():
            if isinstance(m, Attention):
                layers = [(m.qkv_proj, False), (m.o_proj, False)]
            elif isinstance(m, MLP):
                layers = [(m.gate_up_proj, True), (m.down_proj, False)]
            else:
                continue
            for layer, gated in layers:
                if type(layer) is nn.Linear:
                    shapes.setdefault((*layer.weight.shape, gated), layer.weight)
        if type(self.lm_head) is nn.Linear:
            shapes.setdefault((*self.lm_head.weight.shape, False), self.lm_head.weight)
        return bf16_gemv.precompile([(w, gated) for (_, _, gated), w in shapes.items()])

    def active_decoder_params(self) -> int:
        """The decoder layers' weights one token runs through: all of them for a dense model; of a sparse
        MLP only its top-k experts' (what a step's GEMM time scales with)."""
        total = sum(p.numel() for p in self.layers.parameters())
        return total - sum(m.inactive_params() for m in self.layers.modules() if isinstance(m, SparseMoE))

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed_tokens.weight

    def init_rotary(self, device: torch.device | str) -> None:
        self.rotary.build(torch.device(device), self.embed_tokens.weight.dtype)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """Per layer a contiguous [2, num_blocks, block_size, K, D] cache (k, v); owned by the runner,
        outside graph pools."""
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            if not kv.is_contiguous():
                raise ValueError("each layer's KV cache must be contiguous (viewed as flat slots)")
            attn = cast(DecoderLayer, layer).attn
            attn.kv_cache = kv.view(2, -1, kv.shape[-2], kv.shape[-1])  # [2, num_slots, K, D]
            attn.k_slots, attn.v_slots = attn.kv_cache.unbind(0)
            attn.k_blocks, attn.v_blocks = kv.unbind(0)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        logits_indices: torch.Tensor,
        out_logits: torch.Tensor,
    ) -> None:
        # input_ids [T] int64, positions [T] int64, slot_mapping [T] int64 (KV slot per token),
        # logits_indices [R] int64 (token row per logits row), out_logits [R, V] model dtype, written in place.
        h, residual = self.decode_layers(input_ids, positions, slot_mapping)
        # Only the R rows that need logits go through the final norm and the [hidden, V] head.
        self.head_into(self.final_norm(h, residual, logits_indices), out_logits)

    def decode_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding and every decoder layer (the KV writes included): (h, residual), [T, hidden] each,
        before the final norm (which adds them)."""
        h, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            h, residual = layer(positions, slot_mapping, h, residual)
        return h, cast(torch.Tensor, residual)  # set by the first layer

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final hidden states of the token rows `rows` ([N] int64): norm(h + residual), [N, hidden]."""
        out, _ = self.norm.add_forward(h.index_select(0, rows), residual.index_select(0, rows), self.fused)
        return out

    def head_into(self, h: torch.Tensor, out_logits: torch.Tensor) -> None:
        """The LM head of final hidden states h [R, hidden] into out_logits [R, V] (in place)."""
        if self.tp.enabled:
            cast(ParallelLMHead, self.lm_head).logits_into(h, out_logits)  # [R, V]: all-gather of [R, V / N]
        elif self.small_gemm and bf16_gemv.runs_kernel(h, self.lm_head.weight):
            bf16_gemv.small_mm(h, self.lm_head.weight, out=out_logits)
        else:
            torch.mm(h, self.lm_head.weight.t(), out=out_logits)  # [R, V], no [R, V] temporary

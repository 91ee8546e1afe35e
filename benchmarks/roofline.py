"""The H200 roofline of a run and of a step (issue 41): the least time the GPU could take, from the model's
config and the token counts alone. Pure Python, no torch: tests and CPU-side tools import it.

The model (every count is a lower bound of what any kernel must do):
- **Weights.** One weight read is every parameter once: the decoder's linear layers (all experts of an MoE
  layer), the embedding table and, when untied, the LM head; norms and biases are left out (under 0.01%).
  The embedding table is counted in full, as the issue's "16 GB weight read" of the 8B shape does, though a
  step's gather reads only its rows (1.05 GB of 16.06 GB at 8B).
- **GEMM FLOPs.** 2 x the active linear parameters per fed token (attention projections, the MLP, or the
  router plus experts_per_tok experts and any shared expert), plus 2 x hidden x vocab for each row that
  samples (the LM head: a request's last prompt token and each fed output token). Attention's own
  matmuls (QK^T, PV) are not GEMMs here (under 1% of an 8B prefill at realistic lengths).
- **KV reads.** A row reads the KV of every position it attends to once: a decode row at position s reads
  s + 1 tokens' K and V, a prefill chunk at start s with n tokens reads s + n (each key once, whatever the
  kernel's tiling). KV bytes a token: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes.
- **FP8** (--quantization fp8, or an FP8 checkpoint): the decoder's linear weights are 1 byte and their
  GEMMs run at the FP8 peak; the embedding and LM head stay 16-bit (the engine's FP8 path keeps them), as
  does the KV cache unless it is FP8 itself (kv_cache_dtype fp8: 1 byte a value).

A **step's** bound: max(one weight read, its GEMM FLOPs at peak) + its KV read. GEMMs and attention run one
after the other, and a GEMM is bound by whichever of its weight read and its FLOPs is longer.

A **run's** bound, as the issue defines it: the run's GEMM FLOPs at peak plus its KV reads, and never less
than the longest request's steps x one weight read (a request's N output tokens take at least N steps: the
prefill step samples the first, then one a step; speculative decoding, which can emit more, is not
modelled). Each request is counted from its prompt and output lengths: prompt P and N output tokens feed
P + N - 1 tokens (the last output token is never fed), sample N rows, and read N x P + N(N - 1)/2 tokens of
KV (the whole prompt once at prefill, then P + i at the i-th fed output token). Prefix-cache hits are
ignored: every prompt token counts as computed, so a run with hits can exceed 100% of its bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# /work/.library/device/H200.md ("The chip"): HBM3e at 4.8 TB/s and dense bf16 about 990 TFLOP/s by the
# vendor's datasheet. The doc gives no FP8 rate; Hopper's dense FP8 tensor rate is twice its bf16 rate
# (the same datasheet's 1,979 TFLOP/s), so the FP8 peak is taken as 2 x the bf16 figure.
H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_DENSE_FLOPS = 990e12
H200_FP8_DENSE_FLOPS = 2 * H200_BF16_DENSE_FLOPS


@dataclass(frozen=True)
class Device:
    """The ceilings a bound is taken against."""

    hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S
    bf16_flops: float = H200_BF16_DENSE_FLOPS
    fp8_flops: float = H200_FP8_DENSE_FLOPS


H200 = Device()
# The H100 SXM's datasheet: HBM3 at 3.35 TB/s, dense bf16 989 TFLOP/s, dense FP8 1,979. The device tool lends
# one when no H200 comes; its runs are set against this as well as against the H200 bound.
H100 = Device(hbm_bytes_per_s=3.35e12, bf16_flops=989e12, fp8_flops=1979e12)


def device_named(name: str) -> tuple[str, Device] | None:
    """The roofline of a GPU by its reported name (torch.cuda.get_device_name), or None for one this file
    has no figures for."""
    for label, device in (("H200", H200), ("H100", H100)):
        if label in name:
            return label, device
    return None


def hbm_gb_s(name: str) -> float:
    """The HBM bandwidth a GPU's kernels are measured against, GB/s: its own where this file has figures
    (an H100 when the lent H200 did not come), else the H200's."""
    named = device_named(name)
    return (named[1] if named else H200).hbm_bytes_per_s / 1e9


@dataclass(frozen=True)
class ModelShape:
    """What a bound needs of a Hugging Face config.json (from_config)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense MLP's rows (unused by an MoE layer)
    vocab: int
    tied: bool
    experts: int = 0  # 0: a dense MLP
    experts_per_tok: int = 0
    moe_intermediate: int = 0  # one expert's rows
    shared_intermediate: int = 0  # a shared expert's rows (Qwen2-MoE), 0 when none

    @classmethod
    def from_config(cls, cfg: dict) -> ModelShape:
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        # Mixtral's experts have intermediate_size rows; Qwen-MoE names them moe_intermediate_size.
        moe_rows = cfg.get("moe_intermediate_size") or (cfg["intermediate_size"] if experts else 0)
        return cls(
            hidden=hidden,
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
            experts=experts,
            experts_per_tok=(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate=moe_rows if experts else 0,
            shared_intermediate=(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0,
        )

    @property
    def _attention_params(
        self,
    ) -> int:  # q and o: hidden x heads*head_dim; k and v: hidden x kv_heads*head_dim
        return 2 * self.hidden * self.head_dim * (self.heads + self.kv_heads)

    @property
    def _shared_params(self) -> int:  # a shared expert's gate/up/down and its one-row gate
        return 3 * self.hidden * self.shared_intermediate + self.hidden if self.shared_intermediate else 0

    @property
    def linear_params(self) -> int:
        """The decoder's linear weights, all of them (every expert)."""
        if self.experts:
            mlp = self.hidden * self.experts + self.experts * 3 * self.hidden * self.moe_intermediate
            mlp += self._shared_params
        else:
            mlp = 3 * self.hidden * self.intermediate
        return self.layers * (self._attention_params + mlp)

    @property
    def active_linear_params(self) -> int:
        """The decoder's linear weights one token multiplies (the router and experts_per_tok experts)."""
        if self.experts:
            mlp = self.hidden * self.experts + self.experts_per_tok * 3 * self.hidden * self.moe_intermediate
            mlp += self._shared_params
        else:
            mlp = 3 * self.hidden * self.intermediate
        return self.layers * (self._attention_params + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def embedding_tables(self) -> int:
        """Vocab x hidden tables stored: the embedding, and the LM head when untied."""
        return 1 if self.tied else 2


@dataclass(frozen=True)
class RunBound:
    """A run's bound (Roofline.run_bound) and what it is made of; seconds unless named otherwise."""

    seconds: float
    gemm_s: float
    kv_s: float
    weight_floor_s: float  # max_steps x one weight read
    gemm_flops: float
    kv_bytes: float
    weight_bytes: float
    output_tokens: int
    fed_tokens: int
    max_steps: int
    fp8: bool

    @property
    def tokens_per_s(self) -> float:
        """Output tokens a second at the bound."""
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def limit(self) -> str:
        """Which term sets the bound: gemm+kv or weights (the longest request's steps)."""
        return "weights" if self.weight_floor_s > self.gemm_s + self.kv_s else "gemm+kv"

    def achieved(self, measured_s: float) -> float:
        """Bound seconds / measured seconds: 1.0 is at the roofline."""
        return self.seconds / measured_s if measured_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "bound_s": self.seconds,
            "bound_tok_s": self.tokens_per_s,
            "bound_limit": self.limit,
            "gemm_s": self.gemm_s,
            "kv_s": self.kv_s,
            "weight_floor_s": self.weight_floor_s,
            "gemm_flops": self.gemm_flops,
            "kv_bytes": self.kv_bytes,
            "weight_bytes": self.weight_bytes,
            "output_tokens": self.output_tokens,
            "fed_tokens": self.fed_tokens,
            "max_steps": self.max_steps,
            "fp8": self.fp8,
        }


@dataclass(frozen=True)
class Roofline:
    """The bound of steps and runs of one model shape on one device."""

    shape: ModelShape
    fp8: bool = False  # FP8 linear weights and GEMMs
    dtype_bytes: int = 2  # the 16-bit dtype of everything else (the KV cache, embedding, LM head)
    kv_fp8: bool = False  # an FP8 KV cache (kv_cache_dtype fp8): 1 byte a K or V value
    device: Device = H200

    @property
    def weight_bytes(self) -> float:
        s = self.shape
        linear = s.linear_params * (1 if self.fp8 else self.dtype_bytes)
        return linear + s.embedding_tables * s.lm_head_params * self.dtype_bytes

    @property
    def weight_read_s(self) -> float:
        return self.weight_bytes / self.device.hbm_bytes_per_s

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.layers * s.kv_heads * s.head_dim * (1 if self.kv_fp8 else self.dtype_bytes)

    def gemm_flops(self, fed_tokens: float, sampled_rows: float) -> float:
        s = self.shape
        return 2.0 * s.active_linear_params * fed_tokens + 2.0 * s.lm_head_params * sampled_rows

    def gemm_s(self, fed_tokens: float, sampled_rows: float) -> float:
        """The GEMMs' FLOPs at peak: the linear layers at FP8's when fp8, the LM head at bf16's."""
        s, d = self.shape, self.device
        linear = 2.0 * s.active_linear_params * fed_tokens / (d.fp8_flops if self.fp8 else d.bf16_flops)
        return linear + 2.0 * s.lm_head_params * sampled_rows / d.bf16_flops

    def kv_s(self, context_tokens: float) -> float:
        return context_tokens * self.kv_bytes_per_token / self.device.hbm_bytes_per_s

    def step_bound_s(self, fed_tokens: float, sampled_rows: float, context_tokens: float | None) -> float:
        """One step: max(weight read, GEMM FLOPs at peak) + its KV read (context_tokens: the sum over its rows
        of the positions each attends to; None leaves the KV read out)."""
        gemm = max(self.weight_read_s, self.gemm_s(fed_tokens, sampled_rows))
        return gemm + (self.kv_s(context_tokens) if context_tokens is not None else 0.0)

    def run_bound(self, lengths: Iterable[tuple[int, int]]) -> RunBound:
        """The bound of a run of requests given as (prompt tokens, output tokens)."""
        fed = sampled = max_steps = 0
        kv_tokens = 0.0
        for prompt, output in lengths:
            if output < 1:
                raise ValueError(f"a request must produce at least one token (got {output})")
            fed += prompt + output - 1
            sampled += output
            kv_tokens += output * prompt + output * (output - 1) / 2
            max_steps = max(max_steps, output)
        gemm, kv = self.gemm_s(fed, sampled), self.kv_s(kv_tokens)
        floor = max_steps * self.weight_read_s
        return RunBound(
            seconds=max(gemm + kv, floor),
            gemm_s=gemm,
            kv_s=kv,
            weight_floor_s=floor,
            gemm_flops=self.gemm_flops(fed, sampled),
            kv_bytes=kv_tokens * self.kv_bytes_per_token,
            weight_bytes=self.weight_bytes,
            output_tokens=sampled,
            fed_tokens=fed,
            max_steps=max_steps,
            fp8=self.fp8,
        )


def is_fp8(quantization: str | None, config: dict) -> bool:
    """Whether the engine serves FP8 linear weights: --quantization fp8, or auto on an FP8 checkpoint (the
    fp8 or compressed-tensors formats of its quantization_config)."""
    if quantization == "fp8":
        return True
    if quantization not in (None, "auto"):
        return False
    method = (config.get("quantization_config") or {}).get("quant_method")
    return method in ("fp8", "compressed-tensors")


def for_config(
    config: dict, quantization: str | None = None, dtype: str = "auto", kv_cache_dtype: str = "auto"
) -> Roofline:
    """The H200 roofline of a config.json; dtype auto is bf16 (what CUDA runs), float32 4 bytes;
    kv_cache_dtype fp8 / fp8_e4m3: 1 byte a cached K or V value."""
    return Roofline(
        ModelShape.from_config(config),
        fp8=is_fp8(quantization, config),
        dtype_bytes=4 if dtype == "float32" else 2,
        kv_fp8=kv_cache_dtype != "auto",
    )


def config_of_shape(name: str) -> dict:
    """The config.json fields a bound reads, of a benchmarks/model_shapes.py shape (llama8b, qwen05b, ...)."""
    from benchmarks.model_shapes import SHAPES

    if name not in SHAPES or "model_vocab_size" not in SHAPES[name]:
        real = [k for k, v in SHAPES.items() if "model_vocab_size" in v]
        raise SystemExit(f"no roofline for shape {name!r}; use one of {', '.join(real)} or --model DIR")
    s = SHAPES[name]
    return {
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s.get("head_dim") or s["hidden"] // s["heads"],
        "intermediate_size": s["intermediate"],
        "vocab_size": s["model_vocab_size"],
        "tie_word_embeddings": s.get("tie_word_embeddings", False),
        **(
            {
                "num_experts": s["experts"],
                "num_experts_per_tok": s["experts_per_tok"],
                "moe_intermediate_size": s["moe_intermediate"],
            }
            if s.get("experts")
            else {}
        ),
    }

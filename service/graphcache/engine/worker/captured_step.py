"""The step function the GraphCache captures, and the static attention metadata its descriptors read.

CapturedStep is the part of ModelRunner (engine/worker/runner.py) the graph cache sees: `_step_fn(desc)`
runs the model over the static input buffers padded to the descriptor, `_input_tensors(desc)` names the
tensors a capture must find at the same addresses, and `_kernel_family(desc)` says which captures share
their kernels' one-time setup. A descriptor's attention metadata must depend on the descriptor alone, so
that a capture outside a step records the kernels a step would: uniform decode reads one DecodeMetadata
per padded batch size (static views over the InputBatch's block tables and lengths, plus the split-KV
workspace of the triton kernel), and a mixed graph with attention inside (mixed_capture_mode=full, the
unified triton kernel) one AttentionMetadata per padded request count. Any other step reads the
metadata of the forward context the runner sets around it (the eager break of a breakable graph).
On an --enable-lora runner the descriptor's `lora` bit also decides the LoRA layers: the step function sets
the adapters' host flag from it, so a plain descriptor's capture records none of their kernels (the graph
of a runner without LoRA) and a LoRA one records them, reading the per-token slot buffer at replay.
"""

from __future__ import annotations

import torch

from graphcache.config import Settings
from graphcache.engine.worker.input_batch import InputBatch
from graphcache.engine.worker.lora_slots import LoraSlots
from graphcache.graphs.descriptor import BatchDescriptor, CaptureSizes
from graphcache.model.attention_metadata import AttentionMetadata, AttentionPlanner, DecodeMetadata
from graphcache.model.config import ModelConfig
from graphcache.model.decode_attention import choose_num_splits, decode_workspace
from graphcache.model.forward_context import RuntimeMode, current_attention_metadata, forward_context
from graphcache.model.fp8_linear import fp8_kernel_variant
from graphcache.model.llama import LlamaModel
from graphcache.model.lora_kernels import lora_kernel_variant
from graphcache.model.moe import moe_kernel_variant


class CapturedStep:
    """ModelRunner's step function and the static metadata of its captured descriptors (a base of
    ModelRunner: the attributes below are set by its __init__)."""

    settings: Settings
    model: LlamaModel
    model_config: ModelConfig
    device: torch.device
    inputs: InputBatch
    lora: LoraSlots | None
    out_logits: torch.Tensor  # [R_max, V] in the model dtype: the LM head writes straight into it
    kv_cache: torch.Tensor  # [layers, 2, blocks, bs, K, D]: the usable blocks
    sizes: CaptureSizes
    max_tokens: int
    max_reqs: int
    max_model_len: int
    max_blocks_per_seq: int
    block_size: int
    num_heads: int
    num_kv_heads: int
    decode_kernel: str
    _planner: AttentionPlanner
    _mixed_in_graph: bool
    _mixed_graph_md: dict[int, AttentionMetadata]
    fp8_layouts: frozenset[tuple[int, int] | None]  # fp8_linear.fp8_layouts(model): empty for 16-bit weights

    # --- the static metadata of uniform decode ---------------------------------------------
    def _alloc_decode(self) -> None:
        """Static state of the decode kernels: the split workspace (triton) or a positions table
        (torch), and one DecodeMetadata per padded batch size, made on first use."""
        c = self.model_config
        self._decode_md: dict[int, DecodeMetadata] = {}
        self._decode_workspace = None
        self._decode_positions = None
        self._decode_in_graph = self.settings.graph_cache.decode_capture_mode == "full"
        if self.decode_kernel == "triton":
            splits = max(
                choose_num_splits(r, self.num_kv_heads, self.max_model_len) for r in [1, *self.sizes]
            )
            self._decode_workspace = decode_workspace(
                self.max_reqs, self.num_heads, c.head_dim, splits, self.device
            )
        elif self.decode_kernel == "torch":
            self._decode_positions = torch.arange(
                self.max_blocks_per_seq * self.block_size, device=self.device
            )

    def decode_metadata(self, num_reqs: int) -> DecodeMetadata:
        """The decode attention metadata of a (padded) batch of num_reqs: static views only."""
        md = self._decode_md.get(num_reqs)
        if md is None:
            splits = 1
            if self.decode_kernel == "triton":
                splits = choose_num_splits(num_reqs, self.num_kv_heads, self.max_model_len)
            md = DecodeMetadata(
                self.decode_kernel,
                self._decode_in_graph,
                self.inputs.block_tables.dev[:num_reqs],
                self.inputs.seq_lens.dev[:num_reqs],
                splits,
                self._decode_workspace,
                self._decode_positions,
            )
            self._decode_md[num_reqs] = md
        return md

    def _decode_path(self, uniform_decode: bool) -> bool:
        return uniform_decode and self.decode_kernel != "varlen"

    # --- the step function the cache captures ---------------------------------------------
    def _run_model(self, num_tokens: int, num_reqs: int) -> None:
        i = self.inputs
        self.model(
            i.input_ids.dev[:num_tokens],
            i.positions.dev[:num_tokens],
            i.slot_mapping.dev[:num_tokens],
            i.logits_indices.dev[:num_reqs],
            self.out_logits[:num_reqs],
        )

    def _step_fn(self, desc: BatchDescriptor) -> None:
        if desc.num_tokens > self.max_tokens or desc.num_reqs > self.max_reqs:
            raise ValueError(
                f"descriptor {desc} exceeds the static buffers ({self.max_tokens} tokens, "
                f"{self.max_reqs} requests); raise max_num_batched_tokens / max_num_seqs"
            )
        md: AttentionMetadata | DecodeMetadata
        if self._decode_path(desc.uniform_decode):
            # The decode metadata depends on the descriptor alone, so a capture outside a step (under
            # the empty context) records the same kernels a step would: full mode puts them in the graph.
            md = self.decode_metadata(desc.num_reqs)
        elif self._mixed_in_graph:
            md = self.mixed_graph_metadata(desc.num_reqs)  # the same: static views over R padded rows
        else:
            md = current_attention_metadata()  # the step's (or, in warmup, the empty) mixed layout
        if self.lora is not None:
            # What a capture records: a step picks the variant by the same flag (StepExecution), so this
            # changes nothing there; a capture outside a step gets the descriptor's variant.
            self.lora.index.active = desc.lora
        elif desc.lora:
            raise ValueError(
                f"descriptor {desc} is a LoRA variant; this runner serves no adapters (--enable-lora)"
            )
        with forward_context(md, desc, self._graph_mode(desc.uniform_decode)):
            self._run_model(desc.num_tokens, desc.num_reqs)

    def _graph_mode(self, uniform_decode: bool) -> RuntimeMode:
        """How a step with a descriptor runs: "full" (attention inside the graph: the decode kernel, or the
        unified kernel for a mixed step) or "breakable"."""
        if self._decode_path(uniform_decode):
            return "full" if self._decode_in_graph else "breakable"
        return "full" if self._mixed_in_graph else "breakable"

    def mixed_graph_metadata(self, num_reqs: int) -> AttentionMetadata:
        """The unified kernel's metadata for a mixed graph of num_reqs (padded) requests: static views
        only, one per size (the InputBatch pads query starts and lengths over those rows)."""
        md = self._mixed_graph_md.get(num_reqs)
        if md is None:
            i = self.inputs
            md = self._planner.plan_in_graph(
                num_reqs=num_reqs,
                query_start_loc=i.cu_seqlens.dev[: num_reqs + 1],
                seq_lens=i.seq_lens.dev[:num_reqs],
                block_tables=i.block_tables.dev[:num_reqs],
            )
            self._mixed_graph_md[num_reqs] = md
        return md

    def _kernel_family(self, desc: BatchDescriptor) -> tuple:
        """What a descriptor's step must set up once (graph cache's capture_warmup=per_kernel): uniform
        decode compiles the decode kernel once per split-KV count; everything else shares its kernels. A
        mixture-of-experts model's expert kernels add their tile variant for the step's token count, FP8
        layers theirs, and a LoRA variant the adapters' kernels."""
        t = desc.num_tokens
        kernels = (
            *moe_kernel_variant(self.model_config, t),
            *fp8_kernel_variant(self.fp8_layouts, t),
            *(lora_kernel_variant(t) if desc.lora else ()),
        )
        if self._decode_path(desc.uniform_decode):
            return ("decode", self.decode_metadata(desc.num_reqs).num_splits, *kernels)
        return ("mixed", *kernels)

    def _input_tensors(self, desc: BatchDescriptor) -> list[torch.Tensor]:
        t, r, i = desc.num_tokens, desc.num_reqs, self.inputs
        return [
            i.input_ids.dev[:t],
            i.positions.dev[:t],
            i.logits_indices.dev[:r],
            self.out_logits[:r],
            i.slot_mapping.dev[:t],
            i.seq_lens.dev,
            i.block_tables.dev,
            i.cu_seqlens.dev,
            self.kv_cache,
            *([self.lora.index.tokens] if desc.lora and self.lora is not None else []),
        ]

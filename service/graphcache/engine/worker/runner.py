"""The model runner (the worker): a StepPlan in, its StepOutput out; layout, replay or eager run, sampling.

Every step: apply the plan's changes to the request table (engine/worker/request_table.py: the requests
this worker holds, and the rows resident on the device), pick the padded descriptor, let the InputBatch
(engine/worker/input_batch.py, the one owner of the static input buffers) lay the step out and plan
its attention metadata, then let the GraphCache replay (or capture) the graph of the descriptor, and
sample the need_logits rows (engine/worker/sampling.py; rank 0 only under tensor parallelism). The
ids sampled stay on the device: the next plan's rows fed the token in flight read them there.
The KV write happens inside the graph, indexed by the static
slot_mapping: padded tokens map to a scratch slot in one extra KV block past the usable ones, and
between steps every entry maps there, so a warmup/capture outside a step writes no real slot.
Decode steps pad to the fine capture sizes, mixed steps to those plus a few coarse buckets above them
(engine/worker/capture_sizes.py); mixed graphs hold the unified attention kernel inside
(mixed_capture_mode=full, with the triton kernel) or call attention as the eager break. Batches bigger
than the largest size, and every step with enforce_eager, run the model eagerly on their real sizes. Logits
come back from a static buffer, rows in the order of the plan's need_logits rows, valid until the next
execute(). A step with PromptLogits rows (prompt logprobs) runs eagerly too, and also computes the logits of
every token those rows fed (StepOutput.prompt_logits). So does a step with pooling rows (embedding
requests: engine/worker/pooler.py), which keeps the final hidden states they pool: a captured graph's
only outputs are the logits rows, and an embedding request is prefill only, where a replay saves the
launches of one step against its prompt's compute (graphs pay off in decode, which it never reaches).

Captures outside a step (warmup, admin) go through `capture()`, which points every token at the
scratch slot and runs under an empty attention context itself, so they write no real KV slot.
The KV cache's size and storage come from engine/worker/kv_cache.py, the descriptors captured at
start from engine/worker/warmup_plan.py.
Each step's attention metadata, descriptor and runtime mode reach the model through the forward context
(model/forward_context.py), set around the step. The runner returns the step's mode in its
StepOutput; step metrics are the engine's, graph-cache metrics the GraphCache's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from graphcache.choices import StepMode
from graphcache.config import Settings
from graphcache.engine.plan import StepOutput, StepPlan
from graphcache.engine.worker.capture_sizes import resolve_capture_sizes
from graphcache.engine.worker.draft_memory import draft_footprint
from graphcache.engine.worker.input_batch import InputBatch, StepLayout
from graphcache.engine.worker.kv_cache import (
    activation_reserve_bytes,
    agree_min_blocks,
    alloc_kv_storage,
    kv_block_bytes,
    num_kv_blocks,
)
from graphcache.engine.worker.lora_slots import LoraSlots, build_lora_slots
from graphcache.engine.worker.pooler import PoolRows, pool_rows, pool_vectors
from graphcache.engine.worker.request_table import RequestTable
from graphcache.engine.worker.sampling import StepSampler
from graphcache.engine.worker.warmup_plan import warmup_descriptors
from graphcache.graphs.cache import GraphCache, WarmupReport
from graphcache.graphs.descriptor import BatchDescriptor, descriptor_for
from graphcache.graphs.policy.config import policy_config_from
from graphcache.metrics import GraphCacheMetrics
from graphcache.model.attention import select_attention_kernel, select_decode_kernel
from graphcache.model.attention_metadata import AttentionMetadata, AttentionPlanner, DecodeMetadata
from graphcache.model.config import ModelLoadError, read_config, resolve_dtype
from graphcache.model.decode_attention import choose_num_splits, decode_workspace
from graphcache.model.forward_context import RuntimeMode, current_attention_metadata, forward_context
from graphcache.model.fused_ops import HAVE_TRITON as HAVE_FUSED_TRITON
from graphcache.model.loader import load_model
from graphcache.model.moe import moe_kernel_variant
from graphcache.model.parallel import TensorParallel
from graphcache.model.prefill_attention import select_prefill_kernel
from graphcache.model.tiny import default_model_dir
from graphcache.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def resolve_device(setting: str) -> torch.device:
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "device=cuda but torch sees no CUDA GPU; set --device auto or cpu (GRAPHCACHE_DEVICE), "
            "or install a CUDA build of torch"
        )
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


class ModelRunner:
    def __init__(
        self,
        settings: Settings,
        metrics: GraphCacheMetrics | None = None,
        *,
        tp: TensorParallel | None = None,
        graph_cache_factory: Callable[..., GraphCache] = GraphCache,
    ) -> None:
        """metrics: the series its graph cache records to (the server's Metrics; a draft model's runner
        gets Metrics.draft_graph_metrics(), series of its own). tp: this process's tensor-parallel shard (a
        rank of a group of settings.model.tensor_parallel_size processes, each running this runner on the
        same batches: docs/TENSOR_PARALLEL.md). None = the whole model in this process. graph_cache_factory: how the GraphCache is built (a TP rank passes
        one that agrees every cache decision with the other ranks)."""
        self.settings = s = settings
        self.tp = tp = tp or TensorParallel.single()
        if s.model.tensor_parallel_size != tp.size:
            raise RuntimeError(
                f"ModelRunner got tensor_parallel_size={s.model.tensor_parallel_size} but a shard of a group of "
                f"{tp.size}: build the runner of each rank with tp=TensorParallel.from_group(), or let the Engine "
                "start the ranks (engine/worker/tp_runner.py, docs/TENSOR_PARALLEL.md)"
            )
        self.device = resolve_device(s.model.device)
        self.device_type = self.device.type
        self.dtype = resolve_dtype(
            "bfloat16"
            if s.model.dtype == "auto" and self.device.type == "cuda"
            else "float32"
            if s.model.dtype == "auto"
            else s.model.dtype
        )
        # A local directory: a hub id was fetched by the engine, which passes its snapshot directory.
        path = (
            Path(s.model.path).expanduser()
            if s.model.path is not None
            else default_model_dir(s.model.cache_dir, seed=s.model.seed)
        )
        self.model_path = path
        self.tokenizer = Tokenizer(path)
        self.tokenizer.check_chat_template(s.http.chat_template)
        self.max_model_len = self._max_model_len(read_config(path))
        # The GPU's free memory before this process put anything on it: gpu_memory_utilization counts what
        # the server takes from here on (kv_cache.py).
        self._start_free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        self.model, self.model_config = load_model(
            path,
            self.dtype,
            self.device,
            max_positions=self.max_model_len,
            tp=tp,
            quantization=s.model.quantization,
        )
        c = self.model_config
        # One Triton kernel each for add+RMSNorm, rotary and SiLU*mul instead of ~35 small torch kernels a layer.
        self.fused_ops = s.model.fused_ops == "auto" and self.device.type == "cuda" and HAVE_FUSED_TRITON
        self.model.use_fused_ops(self.fused_ops)
        # Steps of 1-64 rows through bf16_gemv's kernel (16-bit plain layers on CUDA; compiled here, before captures).
        self.model.use_small_gemm(s.engine.bf16_small_gemm and self.device.type == "cuda")
        # This rank's heads: its KV cache, attention plan and decode kernels see only those.
        self.num_heads, self.num_kv_heads = c.num_heads // tp.size, c.num_kv_heads // tp.size
        self.block_size = s.engine.block_size
        self.vocab_size = self.model_config.vocab_size
        eos = self.tokenizer.eos_token_ids or self.model_config.eos_token_ids
        self.eos_token_ids = frozenset(eos or ())
        self.backend = "cuda" if self.device.type == "cuda" and not s.graph_cache.enforce_eager else "eager"
        decoder_params = self.model.active_decoder_params()
        self.sizes, self.mixed_sizes = resolve_capture_sizes(
            s, graphs=self.backend == "cuda", decoder_params=decoder_params, num_layers=c.num_layers
        )
        self._warmup_descs = warmup_descriptors(
            s, self.sizes, self.mixed_sizes, graphs=self.backend == "cuda"
        )
        self._alloc_buffers()
        # Before the KV cache: the adapters' slot buffers are part of what the model takes from the GPU.
        self.lora: LoraSlots | None = None
        if s.lora.enable_lora:
            self.lora = build_lora_slots(
                s, self.model, c, max_tokens=self.max_tokens, dtype=self.dtype, device=self.device,
                graphs=self.backend == "cuda", tp_size=tp.size,
            )  # fmt: skip
        self._alloc_kv_cache()
        self.attention_kernel = select_attention_kernel(
            self.device, self.dtype, c.head_dim, self.block_size, s.model.attention_backend
        )
        self._planner = AttentionPlanner(
            kernel=self.attention_kernel,
            block_size=self.block_size,
            max_blocks_per_seq=self.max_blocks_per_seq,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=c.head_dim,
            dtype=self.dtype,
            device=self.device,
            prefill_kernel=select_prefill_kernel(
                s.model.prefill_attention, self.device, self.dtype, c.head_dim, self.attention_kernel
            ),
        )
        self.decode_kernel = select_decode_kernel(
            self.device, self.dtype, c.head_dim, self.block_size, s.model.decode_attention_backend
        )
        self._alloc_decode()
        self.inputs = InputBatch(
            max_tokens=self.max_tokens,
            max_reqs=self.max_reqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            scratch_slot=self.scratch_slot,
            planner=self._planner,
            decode_metadata=self.decode_metadata,
            device=self.device,
        )
        self.table = RequestTable(self.inputs.resident_rows())
        # Sampling is rank 0's: the other ranks of a tensor-parallel group run the model on the same plans.
        self.sampling = StepSampler(self.eos_token_ids, s.model.seed) if tp.rank == 0 else None
        self._sampled: torch.Tensor | None = None  # the ids the last step sampled (the step in flight)
        # Mixed graphs with attention inside need the unified kernel (its grid fixed by the descriptor).
        self._mixed_in_graph = (
            s.graph_cache.mixed_capture_mode == "full" and self.attention_kernel == "triton"
        )
        self._mixed_graph_md: dict[int, AttentionMetadata] = {}
        self.cache = graph_cache_factory(
            self._step_fn,
            backend=self.backend,
            config=policy_config_from(s.graph_cache),
            debug=s.graph_cache.graph_debug,
            metrics=metrics,
            input_tensors=self._input_tensors,
            warm_key=self._kernel_family,
        )
        log.info(
            "model %s (%s) on %s %s: max_model_len %d, %d KV blocks x %d tokens, backend %s",
            path,
            self.model_config.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.max_model_len,
            self.num_kv_blocks,
            self.block_size,
            self.backend,
        )

    # --- sizing -------------------------------------------------------------------------
    def _max_model_len(self, config) -> int:
        limit = config.max_position_embeddings
        if config.sliding_window:  # we attend over the full context: stay inside the window
            limit = min(limit, config.sliding_window)
        wanted = self.settings.engine.max_model_len
        if wanted is not None and wanted > limit:
            raise ModelLoadError(
                f"max_model_len {wanted} exceeds the model's limit {limit} "
                "(max_position_embeddings / sliding_window); lower --max-model-len "
                "(GRAPHCACHE_MAX_MODEL_LEN) or leave it unset"
            )
        return wanted or limit

    def _alloc_buffers(self) -> None:
        s, dev = self.settings, self.device
        max_reqs = self.sizes.pad(s.engine.max_num_seqs) or s.engine.max_num_seqs
        self.max_tokens = max(
            [s.engine.max_num_batched_tokens, self.mixed_sizes.max]
            + [d.num_tokens for d in self._warmup_descs]
        )
        self.max_reqs = min(self.max_tokens, max([max_reqs] + [d.num_reqs for d in self._warmup_descs]))
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        # [R_max, V] in the model dtype: the LM head writes straight into it.
        self.out_logits = torch.zeros(
            self.max_reqs, self.model_config.vocab_size, dtype=self.dtype, device=dev
        )

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

    def _alloc_kv_cache(self) -> None:
        """Size the KV cache (engine/worker/kv_cache.py), allocate it and bind it to the model's layers."""
        c = self.model_config
        s = self.settings
        # What comes after the cache: the graph pools (the cache evicts past cache_max_bytes) and a step's
        # activations (only gpu_memory_utilization counts them: kv_cache_memory_fraction leaves the rest free).
        reserve = s.graph_cache.max_bytes + activation_reserve_bytes(
            c,
            max_tokens=self.max_tokens,
            max_reqs=self.max_reqs,
            tp_size=self.tp.size,
            itemsize=self.dtype.itemsize,
        )
        block_bytes = kv_block_bytes(c, self.block_size, self.num_kv_heads, self.dtype)
        # A draft model (speculative decoding) loads after this cache with a cache of as many blocks.
        draft = draft_footprint(
            s,
            block_size=self.block_size,
            dtype=self.dtype,
            max_tokens=self.max_tokens,
            max_reqs=self.max_reqs,
            max_model_len=self.max_model_len,
        )
        blocks = num_kv_blocks(
            s,
            block_bytes=block_bytes + (draft.block_bytes if draft else 0),
            max_blocks_per_seq=self.max_blocks_per_seq,
            max_model_len=self.max_model_len,
            device=self.device,
            start_free=self._start_free,
            reserve=reserve,
            late_bytes=draft.fixed_bytes if draft else 0,
        )
        self.num_kv_blocks = agree_min_blocks(blocks, self.tp, self.device)
        self.kv_storage = alloc_kv_storage(
            c, self.num_kv_blocks, self.block_size, self.num_kv_heads, self.dtype, self.device
        )  # this rank's KV heads, one scratch block past the usable ones
        # [layers, 2, blocks, bs, K, D]: the usable blocks
        self.kv_cache = self.kv_storage[:, :, : self.num_kv_blocks]
        self.scratch_slot = self.num_kv_blocks * self.block_size
        self.model.bind_kv_cache([self.kv_storage[i] for i in range(c.num_layers)])

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
        mixture-of-experts model's expert kernels add their tile variant for the step's token count."""
        moe = moe_kernel_variant(self.model_config, desc.num_tokens)
        if self._decode_path(desc.uniform_decode):
            return ("decode", self.decode_metadata(desc.num_reqs).num_splits, *moe)
        return ("mixed", *moe)

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
        ]

    # --- one step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan, in_flight: torch.Tensor | None = None) -> StepOutput:
        """Run one step and sample it (StepOutput.logits: [need_logits rows, V] in the model dtype, plan
        order, a view of a static buffer valid until the next call). in_flight: the ids the step in flight
        sampled, for a rank that did not sample them (tensor parallel rank > 0); else this runner's own."""
        prev = self._sampled if in_flight is None else in_flight
        self._sampled = None
        num_reqs, num_tokens = plan.num_reqs, plan.num_tokens
        if num_reqs == 0:
            raise ValueError("empty batch")
        if num_tokens > self.max_tokens or num_reqs > self.max_reqs:
            raise ValueError(
                f"batch of {num_tokens} tokens / {num_reqs} requests exceeds the runner's buffers "
                f"({self.max_tokens} / {self.max_reqs}); keep max_num_batched_tokens and "
                "max_num_seqs in the scheduler equal to the settings"
            )
        uniform = plan.uniform_decode
        enforce_eager = self.settings.graph_cache.enforce_eager
        # A verify step (speculative decoding) replays a verify descriptor when a mixed graph's logits rows
        # cover every fed token; else, like prompt logprobs, it needs logits at every fed position of its
        # rows: an eager step on the general layout.
        verify_desc = None
        if plan.verify and not plan.prompt_logits and not plan.pooling and not enforce_eager:
            verify_desc = self.verify_descriptor(num_tokens, num_reqs)
        wants_prompt = bool(plan.prompt_logits) or (bool(plan.verify) and verify_desc is None)
        pooling = bool(plan.pooling)
        wants_prompt = wants_prompt or pooling  # the same eager path, keeping the pooled rows' hidden states
        eager = enforce_eager or wants_prompt
        desc = (
            None
            if eager
            else verify_desc
            or descriptor_for(num_tokens, num_reqs, uniform, self.sizes, self.max_reqs, self.mixed_sizes)
        )
        pad_tokens = desc.num_tokens if desc else num_tokens
        pad_reqs = desc.num_reqs if desc else num_reqs
        prompt_logits = verify_logits = None
        pooled_keys: list[int] = []
        pooled = None
        try:
            self.table.update(plan)
            if self.lora is not None:
                self.lora.update(plan)
                self.lora.prepare(plan, pad_tokens)
            layout = self.inputs.prepare(
                self.table,
                plan,
                decode=self._decode_path(uniform) and not wants_prompt,
                pad_tokens=pad_tokens,
                pad_reqs=pad_reqs,
                prev_tokens=prev,
                all_logits=verify_desc is not None,
            )
            md = layout.metadata
            with forward_context(md, desc, "eager" if desc is None else self._graph_mode(uniform)):
                if wants_prompt:
                    pool = pool_rows(plan, layout.pool_rows, self.table) if pooling else None
                    logits, prompt_logits, verify_logits, hidden = self._run_with_prompt_logits(layout, pool)
                    if pool is not None and hidden is not None and pool.segments:
                        with torch.inference_mode():
                            pooled_keys, pooled = pool_vectors(hidden, pool)
                    mode: StepMode = "eager"
                else:
                    logits = self.out_logits[: layout.num_logits]
                    if desc is None:
                        self._run_model(num_tokens, num_reqs)
                        mode = "eager"
                    else:
                        mode = self.cache.run(desc, real_tokens=num_tokens)
                        if verify_desc is not None:  # logits row t = token row t
                            logits, verify_logits = self._verify_logits(layout)
        except BaseException:
            self.inputs.invalidate(self.table)  # the buffers may hold half a step: lay the next one out anew
            raise
        if pooled is not None and pooled.is_cuda:  # queued before the sampler records the step's event
            host = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
            pooled = host.copy_(pooled, non_blocking=True)
        if self.sampling is None or not plan.sample:
            self.table.sampled_by_step(plan.sampled_keys())  # rank > 0: rank 0 sends the ids it samples
            return StepOutput(
                mode, logits, prompt_logits=prompt_logits, pooled_keys=pooled_keys, pooled=pooled
            )
        out = self.sampling(plan, self.table.sampled(plan), logits, mode, prompt_logits, verify_logits)
        out.pooled_keys, out.pooled = pooled_keys, pooled
        self._sampled = out.sampled
        self.table.sampled_by_step(plan.sampled_keys())
        return out

    def verify_descriptor(self, num_tokens: int, num_reqs: int) -> BatchDescriptor | None:
        """The descriptor a verify step of num_tokens fed tokens over num_reqs rows replays: the mixed one
        its tokens pad to, marked verify, when its logits rows (R = T, capped at the logits buffer's rows)
        cover every fed token; None: it runs eagerly."""
        d = descriptor_for(num_tokens, num_reqs, False, self.sizes, self.max_reqs, self.mixed_sizes)
        if d is None or d.num_reqs < num_tokens:
            return None
        return BatchDescriptor(d.num_tokens, d.num_reqs, False, True)

    def _verify_logits(self, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify graph's logits (every fed token's, in token-row order) -> (the need_logits rows' logits,
        the verify rows' logits), gathered (fresh tensors: the sampler may process its rows in place)."""
        every = self.out_logits[: layout.num_tokens]
        dev = self.device
        sample = torch.tensor(layout.sample_rows, dtype=torch.int64).to(dev, non_blocking=True)
        verify = torch.tensor(layout.verify_rows, dtype=torch.int64).to(dev, non_blocking=True)
        return every.index_select(0, sample), every.index_select(0, verify)

    def in_flight_ids(self, plan: StepPlan) -> torch.Tensor | None:
        """The ids sampled by the step in flight that the plan's rows read (None: it has no such row): what
        the tensor-parallel runner broadcasts to the other ranks."""
        if plan.tokens is not None and None not in plan.tokens:
            return None
        return self._sampled

    def _run_with_prompt_logits(
        self, layout: StepLayout, pool: PoolRows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Eager step that also computes the logits of every token of the PromptLogits rows and of the
        verify rows: the model's head runs over the usual logits rows plus those token rows (fresh tensors,
        not the static buffers: their count is up to the whole step's tokens); and the final hidden states
        of pool's token rows. (need_logits rows' logits, the prompt rows' logits or None, the verify rows'
        logits or None, [len(pool.token_rows), hidden] final hidden states or None)."""
        i, num_reqs, num_tokens = self.inputs, layout.num_reqs, layout.num_tokens
        num_prompt, num_verify = len(layout.prompt_rows), len(layout.verify_rows)
        rows = list(layout.prompt_rows) + list(layout.verify_rows)
        extra = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        indices = torch.cat([i.logits_indices.dev[:num_reqs], extra])  # [R + E]
        out = torch.empty(
            num_reqs + len(rows),
            self.model_config.vocab_size,
            dtype=self.dtype,
            device=self.device,
        )
        hidden = None
        with torch.inference_mode():
            h, residual = self.model.decode_layers(
                i.input_ids.dev[:num_tokens], i.positions.dev[:num_tokens], i.slot_mapping.dev[:num_tokens]
            )  # [T, hidden] each
            self.model.head_into(self.model.final_norm(h, residual, indices), out)
            if pool is not None and pool.segments:
                kept = torch.tensor(pool.token_rows, dtype=torch.int64).to(self.device, non_blocking=True)
                hidden = self.model.final_norm(h, residual, kept)  # [E, hidden]
        prompt = out[num_reqs : num_reqs + num_prompt] if num_prompt else None
        verify = out[num_reqs + num_prompt :] if num_verify else None
        return out[: layout.num_logits], prompt, verify, hidden

    # --- captures outside a step (warmup, admin) --------------------------------------------
    def capture(
        self,
        descriptors: list[BatchDescriptor],
        *,
        pin: bool = True,
        progress: Callable[[int, int, str], None] | None = None,
    ) -> WarmupReport:
        """Capture `descriptors` now, outside any step (pinned by default). The captured run and the
        replay after it attend to nothing and write K/V only to the scratch slot: every token is
        pointed there and every logits row at token 0 first, so stale buffers from the last step
        can reach no real slot and no index is out of range for any descriptor."""
        too_big = [
            str(d) for d in descriptors if d.num_tokens > self.max_tokens or d.num_reqs > self.max_reqs
        ]
        if too_big:
            raise ValueError(
                f"descriptors {too_big} exceed the static buffers ({self.max_tokens} tokens, "
                f"{self.max_reqs} requests); raise max_num_batched_tokens / max_num_seqs"
            )
        self.inputs.point_at_scratch(self.table)
        with forward_context(AttentionMetadata.empty()):
            return self.cache.warmup(descriptors, pin=pin, progress=progress)

    def warmup_descriptors(self) -> list[BatchDescriptor]:
        """The configured warmup (settings' decode sizes and descriptors, or the profile); none with
        enforce_eager."""
        return [] if self.settings.graph_cache.enforce_eager else list(self._warmup_descs)

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> WarmupReport:
        """Capture the settings' warmup descriptors (pinned; enforce_eager: nothing to capture), and compile
        the sampler's kernels (CUDA; not in the first sampled step, where a compile stalls every request)."""
        report = (
            WarmupReport()
            if self.settings.graph_cache.enforce_eager
            else self.capture(self._warmup_descs, pin=True, progress=progress)
        )
        if self.sampling is not None and self.device.type == "cuda":
            self.sampling.warmup(self.vocab_size, self.dtype, self.device)
        return report

    # --- lifetime -------------------------------------------------------------------------
    def watch(self, on_fatal: Callable[[str], None]) -> None:
        """Nothing to watch: one process, no other rank that could die while the engine idles."""

    def close(self) -> None:
        """Nothing outlives this object: weights, KV cache and graph pools go with its last reference."""

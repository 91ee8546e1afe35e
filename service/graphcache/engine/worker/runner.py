"""The model runner (the worker): a StepPlan in, its StepOutput out; what it builds and holds.

ModelRunner loads the model and sizes everything static a step runs over: the capture sizes
(engine/worker/capture_sizes.py), the descriptors captured at start (engine/worker/warmup_plan.py), the
logits buffer, the KV cache (engine/worker/kv_cache.py), the attention kernels and planner, the InputBatch
(engine/worker/input_batch.py, the one owner of the static input buffers), the request table, the sampler
and the GraphCache. Its steps are StepExecution's (engine/worker/step_execution.py: `execute(plan)`), and
the step function the cache captures is CapturedStep's (engine/worker/captured_step.py).
The KV write happens inside the graph, indexed by the static
slot_mapping: padded tokens map to a scratch slot in one extra KV block past the usable ones, and
between steps every entry maps there, so a warmup/capture outside a step writes no real slot.
Decode steps pad to the fine capture sizes, mixed steps to those plus a few coarse buckets above them
(engine/worker/capture_sizes.py); mixed graphs hold the unified attention kernel inside
(mixed_capture_mode=full, with the triton kernel) or call attention as the eager break.

Captures outside a step (warmup, admin) go through `capture()`, which points every token at the
scratch slot and runs under an empty attention context itself, so they write no real KV slot.
Step metrics are the engine's, graph-cache metrics the GraphCache's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from graphcache.config import Settings
from graphcache.engine.worker.capture_sizes import resolve_capture_sizes
from graphcache.engine.worker.draft_memory import draft_footprint
from graphcache.engine.worker.input_batch import InputBatch
from graphcache.engine.worker.kv_cache import (
    activation_reserve_bytes,
    agree_min_blocks,
    alloc_kv_storage,
    device_free_bytes,
    kv_block_bytes,
    num_kv_blocks,
)
from graphcache.engine.worker.lora_slots import LoraSlots, build_lora_slots
from graphcache.engine.worker.request_table import RequestTable
from graphcache.engine.worker.sampling import StepSampler
from graphcache.engine.worker.step_execution import StepExecution
from graphcache.engine.worker.warmup_plan import warmup_descriptors
from graphcache.graphs.cache import GraphCache, WarmupReport
from graphcache.graphs.descriptor import BatchDescriptor
from graphcache.graphs.policy.config import policy_config_from
from graphcache.metrics import GraphCacheMetrics
from graphcache.model.attention import select_attention_kernel, select_decode_kernel
from graphcache.model.attention_metadata import AttentionMetadata, AttentionPlanner
from graphcache.model.config import ModelLoadError, read_config, resolve_dtype
from graphcache.model.forward_context import forward_context
from graphcache.model.fp8_linear import fp8_layouts
from graphcache.model.fused_ops import HAVE_TRITON as HAVE_FUSED_TRITON
from graphcache.model.kv_dtype import cache_dtype
from graphcache.model.loader import kv_cache_scale_names, load_model
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


class ModelRunner(StepExecution):
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
        # The GPU's free memory before this runner put anything on it: gpu_memory_utilization counts what
        # the server takes from here on (kv_cache.py). Read after what an earlier engine of this process left
        # in the caching allocator is given back, which is free for this one.
        self._start_free = (
            device_free_bytes(self.device, collect=True)[0] if self.device.type == "cuda" else None
        )
        self.model, self.model_config = load_model(
            path,
            self.dtype,
            self.device,
            max_positions=self.max_model_len,
            tp=tp,
            quantization=s.model.quantization,
        )
        c = self.model_config
        self.fp8_layouts = fp8_layouts(self.model)  # what a capture's warm-up key needs of FP8 layers
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
            s,
            graphs=self.backend == "cuda",
            decoder_params=decoder_params,
            num_layers=c.num_layers,
            quantized_activations=None in self.fp8_layouts,  # per-row FP8 weights: x quantized per row
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
                tp_size=tp.size,
            )  # fmt: skip
        # The cache's dtype: the model's, or FP8 (settings.model.kv_cache_dtype; model/kv_dtype.py).
        self.kv_dtype = cache_dtype(s.model.kv_cache_dtype, self.dtype)
        if self.kv_dtype != self.dtype and (scales := kv_cache_scale_names(path)):
            log.warning(
                "the checkpoint calibrated KV-cache scales (%d tensors such as %s) that are not applied: the FP8 "
                "cache stores K and V with a scale of 1, saturated at +-448 (model/kv_dtype.py); if the model's "
                "K or V exceed that, serve it with kv_cache_dtype=auto",
                len(scales),
                scales[0],
            )
        self._alloc_kv_cache()
        self.attention_kernel = select_attention_kernel(
            self.device, self.dtype, c.head_dim, self.block_size, s.model.attention_backend
        )
        if self.kv_dtype != self.dtype and self.attention_kernel in ("flash", "flash_paged"):
            raise RuntimeError(
                f"kv_cache_dtype={s.model.kv_cache_dtype} needs the triton attention (CUDA) or sdpa, not "
                f"{self.attention_kernel} (FlashAttention takes 16-bit K/V); set attention_backend=auto or "
                "triton, or kv_cache_dtype=auto"
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
            kv_dtype=self.kv_dtype,
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
        block_bytes = kv_block_bytes(c, self.block_size, self.num_kv_heads, self.kv_dtype)
        # A draft model (speculative decoding) loads after this cache with a cache of as many blocks.
        draft = draft_footprint(
            s,
            block_size=self.block_size,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
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
            c, self.num_kv_blocks, self.block_size, self.num_kv_heads, self.kv_dtype, self.device
        )  # this rank's KV heads, one scratch block past the usable ones
        # [layers, 2, blocks, bs, K, D]: the usable blocks
        self.kv_cache = self.kv_storage[:, :, : self.num_kv_blocks]
        self.scratch_slot = self.num_kv_blocks * self.block_size
        self.model.bind_kv_cache([self.kv_storage[i] for i in range(c.num_layers)])

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
        lora = [str(d) for d in descriptors if d.lora]
        if lora and self.lora is None:
            raise ValueError(
                f"descriptors {lora} are LoRA variants, but this server serves no adapters; drop ':lora' "
                "or start it with --enable-lora"
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

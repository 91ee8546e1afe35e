"""The model runner: static buffers, batch descriptor, pad, then replay or run eagerly.

Every step: lay the batch out flat (decode requests first, the attention op expects that), copy
ids / positions / slots / block tables into static buffers allocated once at the largest size,
plan the attention metadata once for all layers, then let the GraphCache replay (or capture) the
graph of the padded descriptor. The KV write happens inside the graph, indexed by the static
slot_mapping: padded tokens map to a scratch slot in one extra KV block past the usable ones, and
between steps every entry maps there, so a warmup/capture outside a step writes no real slot.
Batches bigger than the largest capture size, and every step with enforce_eager, run the model
eagerly on their real sizes. Logits come back from a static buffer, rows in the order
of the batch's need_logits sequences, valid until the next execute(). A step with a
`prompt_logits` sequence (prompt logprobs) runs eagerly too, and also returns the logits of every
token that sequence fed (StepResult.prompt_logits).

Captures outside a step (warmup, admin) go through `capture()`, which points every token at the
scratch slot and runs under an empty attention context itself, so they write no real KV slot.
Each step's attention metadata, descriptor and runtime mode reach the model through the forward context
(model/forward_context.py), set around the step. The runner returns the step's mode in its
StepResult; step metrics are the engine's, graph-cache metrics the GraphCache's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from graphcache.config import Settings
from graphcache.engine.batch import StepBatch, StepResult, StepSeq
from graphcache.engine.worker.decode_rows import PersistentRows
from graphcache.engine.worker.staging import StagingBuffer
from graphcache.graphs.cache import GraphCache, WarmupReport
from graphcache.graphs.descriptor import BatchDescriptor, CaptureSizes, descriptor_for
from graphcache.graphs.policy_config import policy_config_from
from graphcache.graphs.profile import parse_profile
from graphcache.metrics import Metrics
from graphcache.model.attention import (
    AttentionMetadata,
    AttentionPlanner,
    DecodeMetadata,
    select_attention_kernel,
    select_decode_kernel,
)
from graphcache.model.config import ModelLoadError, read_config, resolve_dtype
from graphcache.model.decode_attention import choose_num_splits, decode_workspace
from graphcache.model.forward_context import RuntimeMode, current_attention_metadata, forward_context
from graphcache.model.fused_ops import HAVE_TRITON as HAVE_FUSED_TRITON
from graphcache.model.loader import load_model
from graphcache.model.parallel import TensorParallel
from graphcache.model.tiny import default_model_dir
from graphcache.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
CPU_KV_CACHE_MAX_BYTES = 1 << 30  # default CPU KV cache stops here: CPU RAM is shared with everything


def resolve_device(setting: str) -> torch.device:
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA GPU; use device=auto or cpu, or install a "
                           "CUDA build of torch")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


class ModelRunner:
    def __init__(self, settings: Settings, metrics: Metrics | None = None, *, tp: TensorParallel | None = None,
                 graph_cache_factory: Callable[..., GraphCache] = GraphCache) -> None:
        """tp: this process's tensor-parallel shard (a rank of a group of settings.tensor_parallel_size
        processes, each running this runner on the same batches: docs/TENSOR_PARALLEL.md). None = the
        whole model in this process. graph_cache_factory: how the GraphCache is built (a TP rank passes
        one that agrees every cache decision with the other ranks)."""
        self.settings = s = settings
        self.tp = tp = tp or TensorParallel.single()
        if s.tensor_parallel_size != tp.size:
            raise RuntimeError(
                f"ModelRunner got tensor_parallel_size={s.tensor_parallel_size} but a shard of a group of "
                f"{tp.size}: build the runner of each rank with tp=TensorParallel.from_group(), or let the Engine "
                "start the ranks (engine/worker/tp_runner.py, docs/TENSOR_PARALLEL.md)")
        self.device = resolve_device(s.device)
        self.device_type = self.device.type
        self.dtype = resolve_dtype("bfloat16" if s.dtype == "auto" and self.device.type == "cuda"
                                   else "float32" if s.dtype == "auto" else s.dtype)
        path = s.model if s.model is not None else default_model_dir(s.cache_dir, seed=s.seed)
        self.model_path = path
        self.tokenizer = Tokenizer(path)
        self.max_model_len = self._max_model_len(read_config(path))
        self.model, self.model_config = load_model(path, self.dtype, self.device, max_positions=self.max_model_len,
                                                   tp=tp)
        c = self.model_config
        # One Triton kernel each for add+RMSNorm, rotary and SiLU*mul instead of ~35 small torch kernels a layer.
        self.fused_ops = s.fused_ops == "auto" and self.device.type == "cuda" and HAVE_FUSED_TRITON
        self.model.use_fused_ops(self.fused_ops)
        # This rank's heads: its KV cache, attention plan and decode kernels see only those.
        self.num_heads, self.num_kv_heads = c.num_heads // tp.size, c.num_kv_heads // tp.size
        self.block_size = s.block_size
        self.vocab_size = self.model_config.vocab_size
        eos = self.tokenizer.eos_token_ids or self.model_config.eos_token_ids
        self.eos_token_ids = frozenset(eos or ())
        self.sizes = CaptureSizes(s.resolved_capture_sizes())
        self._warmup_descs = self._warmup_descriptors()
        self._alloc_buffers()
        self.num_kv_blocks = self._agree_min(self._num_kv_blocks())
        self._alloc_kv_cache()
        self.persistent_rows = PersistentRows(input_ids=self.input_ids.dev, positions=self.positions.dev,
                                   slot_mapping=self.slot_mapping.dev, seq_lens=self.seq_lens.dev,
                                   block_tables=self.block_tables.dev, logits_indices=self.logits_indices.dev,
                                   block_size=self.block_size, scratch_slot=self.scratch_slot)
        self.attention_kernel = select_attention_kernel(self.device, self.dtype, c.head_dim, self.block_size,
                                                        s.attention_backend)
        self._planner = AttentionPlanner(kernel=self.attention_kernel, block_size=self.block_size,
                                         max_blocks_per_seq=self.max_blocks_per_seq, num_heads=self.num_heads,
                                         num_kv_heads=self.num_kv_heads, head_dim=c.head_dim, dtype=self.dtype,
                                         device=self.device)
        self.decode_kernel = select_decode_kernel(self.device, self.dtype, c.head_dim, self.block_size,
                                                  s.decode_attention_backend)
        self._alloc_decode()
        self.backend = "cuda" if self.device.type == "cuda" and not s.enforce_eager else "eager"
        self.cache = graph_cache_factory(self._step_fn, backend=self.backend, config=policy_config_from(s),
                                         debug=s.graph_debug, metrics=metrics, input_tensors=self._input_tensors,
                                         warm_key=self._kernel_family)
        self._uploaded = torch.cuda.Event() if self.device.type == "cuda" else None
        log.info("model %s (%s) on %s %s: max_model_len %d, %d KV blocks x %d tokens, backend %s", path,
                 self.model_config.architecture, self.device, str(self.dtype).removeprefix("torch."),
                 self.max_model_len, self.num_kv_blocks, self.block_size, self.backend)

    # --- sizing -------------------------------------------------------------------------
    def _max_model_len(self, config) -> int:
        limit = config.max_position_embeddings
        if config.sliding_window:  # we attend over the full context: stay inside the window
            limit = min(limit, config.sliding_window)
        wanted = self.settings.max_model_len
        if wanted is not None and wanted > limit:
            raise ModelLoadError(f"max_model_len {wanted} exceeds the model's limit {limit} "
                                 "(max_position_embeddings / sliding_window); lower max_model_len")
        return wanted or limit

    def _warmup_descriptors(self) -> list[BatchDescriptor]:
        s = self.settings
        if s.warmup_profile is not None:
            return self._load_warmup_profile(s.warmup_profile)   # exactly the profile's set
        decode = s.warmup_decode_sizes
        if decode is None:
            decode = [n for n in self.sizes if n <= s.max_num_seqs]
        descs = [BatchDescriptor(n, n, True) for n in decode]
        descs += [BatchDescriptor.parse(d) for d in s.warmup_descriptors]
        return descs

    def _load_warmup_profile(self, path: Path) -> list[BatchDescriptor]:
        """The descriptors of a GRAPHCACHE_WARMUP_PROFILE file (GET /admin/cache/profile's output). Each
        must be a shape a step pads to (tokens and requests capture sizes, requests within max_num_seqs'
        padded size), so none grows the static buffers; anything else fails the start, naming the file
        and the entry."""
        where = f"warmup_profile {str(path)!r} (GRAPHCACHE_WARMUP_PROFILE)"
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{where} cannot be read as JSON: {type(e).__name__}: {e}") from None
        try:
            descs = parse_profile(data)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        max_reqs = self.sizes.pad(self.settings.max_num_seqs) or self.sizes.max
        for i, d in enumerate(descs):
            if d.num_tokens not in self.sizes.sizes or d.num_reqs not in self.sizes.sizes or d.num_reqs > max_reqs:
                raise ValueError(f"{where}: descriptors[{i}] {d} has sizes this server never pads to; tokens and "
                                 f"requests must each be one of the capture sizes {list(self.sizes)} (requests "
                                 f"up to {max_reqs}); export the profile again from a server with these settings")
        log.info("warmup profile %s: %d descriptors", path, len(descs))
        return descs

    def _alloc_buffers(self) -> None:
        s, dev = self.settings, self.device
        max_reqs = self.sizes.pad(s.max_num_seqs) or s.max_num_seqs
        self.max_tokens = max([s.max_num_batched_tokens, self.sizes.max] + [d.num_tokens for d in self._warmup_descs])
        self.max_reqs = min(self.max_tokens, max([max_reqs] + [d.num_reqs for d in self._warmup_descs]))
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        i64 = torch.int64
        self.input_ids = StagingBuffer((self.max_tokens,), i64, dev)         # [T_max]
        self.positions = StagingBuffer((self.max_tokens,), i64, dev)         # [T_max]
        self.slot_mapping = StagingBuffer((self.max_tokens,), i64, dev)      # [T_max]
        self.logits_indices = StagingBuffer((self.max_reqs,), i64, dev)      # [R_max] token row of each logits row
        self.seq_lens = StagingBuffer((self.max_reqs,), i64, dev)            # [R_max]
        self.block_tables = StagingBuffer((self.max_reqs, self.max_blocks_per_seq), i64, dev)  # [R_max, B]
        # [2 * (R_max + 1)] int32: cumulative query lengths, then cumulative context lengths (flash
        # kernel); one buffer so it is one upload, each half contiguous as the kernel wants.
        self.cu_seqlens = StagingBuffer((2 * (self.max_reqs + 1),), torch.int32, dev)
        # Placeholder inputs (async scheduling): token rows to fill, and the previous step's row each
        # takes its sampled id from.
        self.fill_rows = StagingBuffer((self.max_reqs,), i64, dev)     # [R_max]
        self.fill_src = StagingBuffer((self.max_reqs,), i64, dev)      # [R_max]
        # [R_max, V] in the model dtype: the LM head writes straight into it.
        self.out_logits = torch.zeros(self.max_reqs, self.model_config.vocab_size, dtype=self.dtype, device=dev)

    def _alloc_decode(self) -> None:
        """Static state of the decode kernels: the split workspace (triton) or a positions table
        (torch), and one DecodeMetadata per padded batch size, made on first use."""
        c = self.model_config
        self._decode_md: dict[int, DecodeMetadata] = {}
        self._decode_workspace = None
        self._decode_positions = None
        self._decode_in_graph = self.settings.decode_capture_mode == "full"
        if self.decode_kernel == "triton":
            splits = max(choose_num_splits(r, self.num_kv_heads, self.max_model_len) for r in [1, *self.sizes])
            self._decode_workspace = decode_workspace(self.max_reqs, self.num_heads, c.head_dim, splits, self.device)
        elif self.decode_kernel == "torch":
            self._decode_positions = torch.arange(self.max_blocks_per_seq * self.block_size, device=self.device)
        # Host-side row cache of the uniform-decode fast path: which block table (the sequence's own
        # list, and its length) each row of block_tables.np holds, so a step rewrites only rows that
        # changed. Stale after a mixed step (it lays rows out its own way) or a PersistentRows step (it
        # moves the device rows): the next _prepare_decode then rewrites every row.
        self._table_rows: list = [None] * self.max_reqs
        self._table_lens: list[int] = [0] * self.max_reqs
        self._table_rows_stale = False

    def decode_metadata(self, num_reqs: int) -> DecodeMetadata:
        """The decode attention metadata of a (padded) batch of num_reqs: static views only."""
        md = self._decode_md.get(num_reqs)
        if md is None:
            splits = 1
            if self.decode_kernel == "triton":
                splits = choose_num_splits(num_reqs, self.num_kv_heads, self.max_model_len)
            md = DecodeMetadata(self.decode_kernel, self._decode_in_graph, self.block_tables.dev[:num_reqs],
                                self.seq_lens.dev[:num_reqs], splits, self._decode_workspace,
                                self._decode_positions)
            self._decode_md[num_reqs] = md
        return md

    def _decode_path(self, uniform_decode: bool) -> bool:
        return uniform_decode and self.decode_kernel != "varlen"

    def _kv_block_bytes(self) -> int:
        c = self.model_config
        return c.num_layers * 2 * self.block_size * self.num_kv_heads * c.head_dim * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        s = self.settings
        per_block = self._kv_block_bytes()
        if s.num_kv_blocks is not None:
            return s.num_kv_blocks
        one_seq = self.max_blocks_per_seq
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            blocks = int(free * s.kv_cache_memory_fraction) // per_block
        else:
            blocks = min(s.max_num_seqs * one_seq, CPU_KV_CACHE_MAX_BYTES // per_block)
        if blocks < one_seq:
            raise RuntimeError(f"KV cache of {blocks} blocks cannot hold one sequence of max_model_len "
                               f"{self.max_model_len} ({one_seq} blocks); lower max_model_len or raise "
                               "kv_cache_memory_fraction / num_kv_blocks")
        return blocks

    def _agree_min(self, blocks: int) -> int:
        """The smallest KV cache over the ranks: rank 0's block manager hands out blocks for all of them
        (each rank sized its own from its free memory). Every rank calls this at the same point of start-up."""
        if not self.tp.enabled:
            return blocks
        t = torch.tensor([blocks], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp.group)
        return int(t.item())

    def _alloc_kv_cache(self) -> None:
        c = self.model_config
        # Zero-filled, not empty: masked positions get softmax weight 0, and 0 * NaN would still be NaN.
        # One block more than the block manager knows of: block num_kv_blocks is the scratch block
        # that padded tokens write (their K/V may be garbage; nothing ever reads it).
        self.kv_storage = torch.zeros(c.num_layers, 2, self.num_kv_blocks + 1, self.block_size, self.num_kv_heads,
                                      c.head_dim, dtype=self.dtype, device=self.device)   # this rank's KV heads
        self.kv_cache = self.kv_storage[:, :, :self.num_kv_blocks]  # [layers, 2, blocks, bs, K, D]: usable blocks
        self.scratch_slot = self.num_kv_blocks * self.block_size
        self.model.bind_kv_cache([self.kv_storage[i] for i in range(c.num_layers)])

    # --- the step function the cache captures ---------------------------------------------
    def _run_model(self, num_tokens: int, num_reqs: int) -> None:
        self.model(self.input_ids.dev[:num_tokens], self.positions.dev[:num_tokens], self.slot_mapping.dev[:num_tokens],
                   self.logits_indices.dev[:num_reqs], self.out_logits[:num_reqs])

    def _step_fn(self, desc: BatchDescriptor) -> None:
        if desc.num_tokens > self.max_tokens or desc.num_reqs > self.max_reqs:
            raise ValueError(f"descriptor {desc} exceeds the static buffers ({self.max_tokens} tokens, "
                             f"{self.max_reqs} requests); raise max_num_batched_tokens / max_num_seqs")
        if self._decode_path(desc.uniform_decode):
            # The decode metadata depends on the descriptor alone, so a capture outside a step (under
            # the empty context) records the same kernels a step would: full mode puts them in the graph.
            md = self.decode_metadata(desc.num_reqs)
        else:
            md = current_attention_metadata()   # the step's (or, in warmup, the empty) mixed layout
        with forward_context(md, desc, self._graph_mode(desc.uniform_decode)):
            self._run_model(desc.num_tokens, desc.num_reqs)

    def _graph_mode(self, uniform_decode: bool) -> RuntimeMode:
        """How a step with a descriptor runs: "full" (decode attention inside the graph) or "breakable"."""
        return "full" if self._decode_path(uniform_decode) and self._decode_in_graph else "breakable"

    def _kernel_family(self, desc: BatchDescriptor) -> tuple:
        """What a descriptor's step must set up once (graph cache's capture_warmup=per_kernel): uniform
        decode compiles the decode kernel once per split-KV count; everything else shares its kernels."""
        if self._decode_path(desc.uniform_decode):
            return ("decode", self.decode_metadata(desc.num_reqs).num_splits)
        return ("mixed",)

    def _input_tensors(self, desc: BatchDescriptor) -> list[torch.Tensor]:
        t, r = desc.num_tokens, desc.num_reqs
        return [self.input_ids.dev[:t], self.positions.dev[:t], self.logits_indices.dev[:r], self.out_logits[:r],
                self.slot_mapping.dev[:t], self.seq_lens.dev, self.block_tables.dev, self.kv_cache]

    # --- one step ------------------------------------------------------------------------
    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step: logits [number of need_logits seqs, V] in the model dtype, batch order (a
        view of a static buffer, valid until the next call), and how it ran."""
        num_reqs = len(batch.rows.keys) if batch.rows is not None else len(batch.seqs)
        num_tokens = batch.num_tokens
        if num_reqs == 0:
            raise ValueError("empty batch")
        if num_tokens > self.max_tokens or num_reqs > self.max_reqs:
            raise ValueError(f"batch of {num_tokens} tokens / {num_reqs} requests exceeds the runner's buffers "
                             f"({self.max_tokens} / {self.max_reqs}); keep max_num_batched_tokens and "
                             "max_num_seqs in the scheduler equal to the settings")
        uniform = batch.uniform_decode
        # Prompt logprobs need logits at every fed position: an eager step on the general layout.
        prompt_logits = batch.wants_prompt_logits
        eager = self.settings.enforce_eager or prompt_logits
        desc = None if eager else descriptor_for(num_tokens, num_reqs, uniform, self.sizes, self.max_reqs)
        pad_tokens = desc.num_tokens if desc else num_tokens
        pad_reqs = desc.num_reqs if desc else num_reqs
        rows = self.persistent_rows
        try:
            if self._decode_path(uniform) and not prompt_logits:
                if batch.rows is not None and batch.prev_tokens is not None and rows.apply(
                        batch.rows, pad_reqs, batch.prev_tokens, batch.seq_at, self._wait_uploads):
                    self._table_rows_stale = True   # the device rows moved
                    if self._uploaded is not None:
                        self._uploaded.record()
                    md, num_logits = self.decode_metadata(pad_reqs), num_reqs
                else:
                    md, num_logits = self._prepare_decode(batch.seqs, pad_reqs, batch.prev_tokens)
                    rows.remember(batch.keys, self._table_lens[:num_reqs], pad_reqs)
            else:
                md, num_logits = self._prepare(batch.seqs, num_tokens, pad_tokens, pad_reqs, batch.prev_tokens)
                d = self._decode_prefix   # its decode rows, laid out and sampled first, can be the next step's
                if batch.keys is None or d == 0 or prompt_logits:
                    rows.invalidate()
                else:
                    rows.remember(batch.keys[:d], [len(s.block_table) for s in batch.seqs[:d]], 0)
            with forward_context(md, desc, "eager" if desc is None else self._graph_mode(uniform)):
                if prompt_logits:
                    return self._run_with_prompt_logits(batch.seqs, num_tokens, num_logits)
                if desc is None:
                    self._run_model(num_tokens, num_reqs)
                    mode = "eager"
                else:
                    mode = self.cache.run(desc, real_tokens=num_tokens)
        except BaseException:
            rows.invalidate()   # the buffers may hold half a step: the next decode lays rows out anew
            raise
        return StepResult(self.out_logits[:num_logits], mode)

    def takes_rows(self, batch: StepBatch) -> bool:
        """Whether execute(batch) will run it from its DecodeRows alone, no row new to this runner (the
        tensor-parallel runner then sends the other ranks only the rows: their runners hold the same rows)."""
        if batch.rows is None or not self._decode_path(True) or batch.prev_tokens is None:
            return False
        return self.persistent_rows.applicable(batch.rows, batch.prev_tokens.shape[0])

    def _wait_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's async copies have read the host mirrors

    def _run_with_prompt_logits(self, seqs: list[StepSeq], num_tokens: int, num_logits: int) -> StepResult:
        """Eager step that also computes the logits of every token of the prompt_logits seqs: the
        model's head runs over the usual logits rows plus those token rows (fresh tensors, not the
        static buffers: their count is up to the whole step's tokens)."""
        num_reqs = len(seqs)
        rows = [r for i, s in enumerate(seqs) if s.prompt_logits
                for r in range(self._first_row[i], self._first_row[i] + len(s.token_ids))]
        extra = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        indices = torch.cat([self.logits_indices.dev[:num_reqs], extra])                  # [R + E]
        out = torch.empty(num_reqs + len(rows), self.model_config.vocab_size, dtype=self.dtype, device=self.device)
        self.model(self.input_ids.dev[:num_tokens], self.positions.dev[:num_tokens],
                   self.slot_mapping.dev[:num_tokens], indices, out)
        return StepResult(out[:num_logits], "eager", prompt_logits=out[num_reqs:])

    def _prepare(self, seqs: list[StepSeq], num_tokens: int, pad_tokens: int, pad_reqs: int, prev_tokens=None):
        """Fill host mirrors and upload. Layout: decode requests first (attention op contract);
        logits rows: the need_logits seqs in batch order, then the others."""
        self._wait_uploads()
        self._table_rows_stale = True   # rows laid out anew
        bs = self.block_size
        order = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        num_decodes = len(order)
        order += [i for i, s in enumerate(seqs) if len(s.token_ids) != 1]
        ids, pos = [], []
        fills: list[tuple[int, int]] = []   # (token row, previous step's row) of placeholder inputs
        query_start, seq_lens = [0], []
        last_token = [0] * len(seqs)
        # Token row of each sequence's first fed token (batch order), for the prompt-logits rows.
        self._first_row = first_row = [0] * len(seqs)
        bt = self.block_tables.np
        bt[:len(seqs)] = 0
        for row, i in enumerate(order):
            s = seqs[i]
            n, end = len(s.token_ids), s.start_pos + len(s.token_ids)
            if n == 0:
                raise ValueError(f"sequence {i} of the batch feeds no tokens")
            if end > self.max_model_len or len(s.block_table) * bs < end:
                raise ValueError(f"sequence {i} reaches position {end} with {len(s.block_table)} blocks of {bs}; "
                                 f"it needs ceil({end}/{bs}) blocks and at most max_model_len {self.max_model_len}")
            table = s.block_table
            if s.prev_row is not None:
                fills.append((len(ids), s.prev_row))
            ids += s.token_ids
            pos += range(s.start_pos, end)
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            last_token[i] = query_start[-1] - 1
            first_row[i] = query_start[-2]
            bt[row, :len(table)] = table
        pad = pad_tokens - num_tokens
        # Pads: token 0 at position 0 (valid embedding and rotary rows); their K/V go to the scratch slot.
        self.input_ids.np[:pad_tokens] = ids + [0] * pad
        self.positions.np[:pad_tokens] = pos + [0] * pad
        # Slots in one numpy pass, not a Python loop per token (a prefill step feeds thousands).
        token_row = np.repeat(np.arange(len(order)), np.diff(query_start))      # [T] each token's row
        p = self.positions.np[:num_tokens]                                        # [T]
        self.slot_mapping.np[:num_tokens] = bt[token_row, p // bs] * bs + p % bs
        self.slot_mapping.np[num_tokens:pad_tokens] = self.scratch_slot
        need = [i for i, s in enumerate(seqs) if s.need_logits]
        rows = need + [i for i, s in enumerate(seqs) if not s.need_logits]
        # The decodes are rows 0..d-1 and logits rows 0..d-1 when they are the batch's first d seqs and
        # all sample (the scheduler's order: decodes first): then PersistentRows can keep them.
        d = num_decodes
        self._decode_prefix = d if d and order[d - 1] == d - 1 and len(need) >= d and need[d - 1] == d - 1 else 0
        self.logits_indices.np[:pad_reqs] = [last_token[i] for i in rows] + [0] * (pad_reqs - len(rows))
        num_reqs = len(seqs)
        self.seq_lens.np[:num_reqs] = seq_lens
        uploads = [(self.input_ids, pad_tokens), (self.positions, pad_tokens), (self.slot_mapping, pad_tokens),
                   (self.logits_indices, pad_reqs), (self.seq_lens, num_reqs), (self.block_tables, num_reqs)]
        if self.attention_kernel != "sdpa":   # the flash kernels take cumulative lengths
            cu = self.cu_seqlens.np
            cu[:num_reqs + 1] = query_start
            cu[num_reqs + 1] = 0
            np.cumsum(seq_lens, out=cu[num_reqs + 2:2 * num_reqs + 2])
            uploads.append((self.cu_seqlens, 2 * num_reqs + 2))
        for buf, n in uploads:
            buf.upload(n)
        self._fill_placeholders(fills, prev_tokens)
        if self._uploaded is not None:
            self._uploaded.record()
        md = self._planner.plan(num_real_tokens=num_tokens, num_decodes=num_decodes, query_start_loc=query_start,
                                seq_lens=seq_lens, seq_lens_dev=self.seq_lens.dev[:num_reqs],
                                block_tables=self.block_tables.dev[:num_reqs], cu_seqlens=self.cu_seqlens.dev)
        return md, len(need)

    def _prepare_decode(self, seqs: list[StepSeq], pad_reqs: int, prev_tokens=None) -> tuple[DecodeMetadata, int]:
        """Uniform decode: one token per sequence, row i = sequence i = logits row i. Host work is a
        few list comprehensions and numpy ops; a block-table row is rewritten only when its table
        changed since the last decode step (a new sequence in the row, or a new block)."""
        self._wait_uploads()
        if self._table_rows_stale:
            self._table_rows[:] = [None] * len(self._table_rows)
            self._table_rows_stale = False
        n, bs = len(seqs), self.block_size
        bt, rows, lens = self.block_tables.np, self._table_rows, self._table_lens
        for row, s in enumerate(seqs):
            table = s.block_table
            if rows[row] is not table or lens[row] != len(table):
                bt[row, :len(table)] = table
                rows[row], lens[row] = table, len(table)
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)            # [n]
        short = np.flatnonzero((pos >= np.asarray(lens[:n]) * bs) | (pos >= self.max_model_len))
        if short.size:
            i = int(short[0])
            raise ValueError(f"sequence {i} reaches position {pos[i] + 1} with {lens[i]} blocks of {bs}; it needs "
                             f"ceil({pos[i] + 1}/{bs}) blocks and at most max_model_len {self.max_model_len}")
        self.input_ids.np[:n] = [s.token_ids[0] for s in seqs]
        self.positions.np[:n] = pos
        self.slot_mapping.np[:n] = bt[np.arange(n), pos // bs] * bs + pos % bs
        self.seq_lens.np[:n] = pos + 1
        self.logits_indices.np[:pad_reqs] = np.arange(pad_reqs)
        # Pads: token 0 at position 0 writing the scratch slot, length 0 (attention writes zeros).
        self.input_ids.np[n:pad_reqs] = 0
        self.positions.np[n:pad_reqs] = 0
        self.slot_mapping.np[n:pad_reqs] = self.scratch_slot
        self.seq_lens.np[n:pad_reqs] = 0
        for buf in (self.input_ids, self.positions, self.slot_mapping, self.logits_indices, self.seq_lens,
                    self.block_tables):
            buf.upload(pad_reqs)
        self._fill_placeholders([(i, s.prev_row) for i, s in enumerate(seqs) if s.prev_row is not None], prev_tokens)
        if self._uploaded is not None:
            self._uploaded.record()
        return self.decode_metadata(pad_reqs), n

    def _fill_placeholders(self, fills: list[tuple[int, int]], prev_tokens) -> None:
        """Async scheduling: a decode fed the token the previous step is still sampling gets it on the
        device, input_ids[row] = prev_tokens[prev_row], after the upload (stream order), no sync."""
        if not fills:
            return
        if prev_tokens is None:
            raise ValueError("placeholder inputs need StepBatch.prev_tokens (the previous step's sampled ids)")
        k = len(fills)
        self.fill_rows.np[:k] = [row for row, _ in fills]
        self.fill_src.np[:k] = [src for _, src in fills]
        self.fill_rows.upload(k)
        self.fill_src.upload(k)
        self.input_ids.dev.index_copy_(0, self.fill_rows.dev[:k], prev_tokens.index_select(0, self.fill_src.dev[:k]))

    # --- captures outside a step (warmup, admin) --------------------------------------------
    def capture(self, descriptors: list[BatchDescriptor], *, pin: bool = True,
                progress: Callable[[int, int, str], None] | None = None) -> WarmupReport:
        """Capture `descriptors` now, outside any step (pinned by default). The captured run and the
        replay after it attend to nothing and write K/V only to the scratch slot: every token is
        pointed there and every logits row at token 0 first, so stale buffers from the last step
        can reach no real slot and no index is out of range for any descriptor."""
        too_big = [str(d) for d in descriptors if d.num_tokens > self.max_tokens or d.num_reqs > self.max_reqs]
        if too_big:
            raise ValueError(f"descriptors {too_big} exceed the static buffers ({self.max_tokens} tokens, "
                             f"{self.max_reqs} requests); raise max_num_batched_tokens / max_num_seqs")
        self.persistent_rows.invalidate()
        self.slot_mapping.dev.fill_(self.scratch_slot)
        self.logits_indices.dev.zero_()
        self.seq_lens.dev.zero_()   # decode kernels in the graph attend to nothing
        with forward_context(AttentionMetadata.empty()):
            return self.cache.warmup(descriptors, pin=pin, progress=progress)

    def warmup_descriptors(self) -> list[BatchDescriptor]:
        """The configured warmup (settings' decode sizes and descriptors, or the profile); none with
        enforce_eager."""
        return [] if self.settings.enforce_eager else list(self._warmup_descs)

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> WarmupReport:
        """Capture the settings' warmup descriptors (pinned). enforce_eager: nothing to capture."""
        if self.settings.enforce_eager:
            return WarmupReport()
        return self.capture(self._warmup_descs, pin=True, progress=progress)

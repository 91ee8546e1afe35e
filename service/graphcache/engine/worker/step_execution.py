"""One step of the ModelRunner: `execute(plan)`: the request table, the layout, replay or eager run, sampling.

Every step: apply the plan's changes to the request table (engine/worker/request_table.py: the requests
this worker holds, and the rows resident on the device), pick the padded descriptor, let the InputBatch
(engine/worker/input_batch.py, the one owner of the static input buffers) lay the step out and plan
its attention metadata, then let the GraphCache replay (or capture) the graph of the descriptor, and
sample the need_logits rows (engine/worker/sampling.py; rank 0 only under tensor parallelism). The
ids sampled stay on the device: the next plan's rows fed the token in flight read them there.
Batches bigger than the largest size, and every step with enforce_eager, run the model eagerly on their
real sizes. Logits come back from a static buffer, rows in the order of the plan's need_logits rows, valid
until the next execute(). A step with PromptLogits rows (prompt logprobs) runs eagerly too, and also
computes the logits of every token those rows fed (StepOutput.prompt_logits). So does a step with pooling
rows (embedding requests: engine/worker/pooler.py), which keeps the final hidden states they pool: a
captured graph's only outputs are the logits rows, and an embedding request is prefill only, where a
replay saves the launches of one step against its prompt's compute (graphs pay off in decode, which it
never reaches). A verify step (speculative decoding) replays a verify descriptor when its logits rows
cover every fed token. On an --enable-lora runner a step with an adapter token replays its descriptor's LoRA
variant, a step with none the plain one (graphs/descriptor.py: `lora`), as LoraSlots.prepare finds the plan.
Each step's attention metadata, descriptor and runtime mode reach the model through the forward context
(model/forward_context.py), set around the step. The step's mode comes back in its StepOutput.
"""

from __future__ import annotations

import torch

from graphcache.choices import StepMode
from graphcache.engine.plan import StepOutput, StepPlan
from graphcache.engine.worker.captured_step import CapturedStep
from graphcache.engine.worker.input_batch import StepLayout
from graphcache.engine.worker.lora_slots import LoraSlots
from graphcache.engine.worker.pooler import PoolRows, pool_rows, pool_vectors
from graphcache.engine.worker.request_table import RequestTable
from graphcache.engine.worker.sampling import StepSampler
from graphcache.graphs.cache import GraphCache
from graphcache.graphs.descriptor import BatchDescriptor, CaptureSizes, descriptor_for
from graphcache.model.forward_context import forward_context


class StepExecution(CapturedStep):
    """ModelRunner's steps (a base of ModelRunner: the attributes below are set by its __init__)."""

    dtype: torch.dtype
    mixed_sizes: CaptureSizes
    table: RequestTable
    lora: LoraSlots | None
    sampling: StepSampler | None  # rank 0's: the other ranks of a tensor-parallel group sample nothing
    cache: GraphCache
    _sampled: torch.Tensor | None  # the ids the last step sampled (the step in flight)

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
                if desc is not None:  # the LoRA variant only when some row has an adapter
                    desc = desc.with_lora(self.lora.index.active)
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

"""EngineCore: one engine step, with no threads and no asyncio.

`step()` orders three stages and does none of their work: schedule (`Scheduler.schedule`: the step's
rows, and its `StepPlan`, plain data) -> execute (`Runner.execute(plan) -> StepOutput`: the worker lays
the step out, runs the model, samples) -> update (`Scheduler.postprocess`: append tokens, check stops,
finish and free; then the RequestOutput deltas to stream). The Engine (engine.py) calls it in a loop on
its thread and delivers the outputs; tests call it directly. nano-vllm's `LLMEngine.step` and vLLM v1's
`EngineCore.step` are the models.

Failure isolation (failures.py): an exception in a step ends only that step's requests; a request
whose own sampling fails ends alone; a device fault, or MAX_CONSECUTIVE_STEP_FAILURES failed steps in
a row, raises `EngineFailure`. The outputs of the requests a step advanced are built by
RequestOutputs (outputs.py); settings.engine.step_trace records each step's timing (step_trace.py).

Log probabilities (engine/sample/logprobs.py) are computed by the worker in the step that produced the
logits, and reach the host with the sampled tokens: a sampled token's for params.logprobs, and
for params.prompt_logprobs each prompt token's given the tokens before it (the plan's PromptLogits: such
a step runs eagerly; chunks accumulate, entries already recorded are never recorded again, e.g. after a
preemption's recompute). The core records them on the sequences.

Overlap rule (async scheduling): a step whose sampling needs the previous step's tokens on the
host (penalties, min_tokens, bad words, a grammar: `_needs_host_history`) is not overlapped: the
step in flight completes before the next is scheduled.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

from graphcache.config import Settings
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.loop.failures import (
    MAX_CONSECUTIVE_STEP_FAILURES,
    STEP_FAILED_MESSAGE,
    EngineFailure,
    is_device_failure,
)
from graphcache.engine.loop.lora_admin import record_lora_gauges
from graphcache.engine.loop.outputs import RequestOutputs
from graphcache.engine.loop.request_check import EngineLimits, RequestChecker
from graphcache.engine.loop.step_trace import STEP_TRACE_MAX
from graphcache.engine.plan import Runner, StepOutput, StepPlan
from graphcache.engine.sample.controls import needs_history
from graphcache.engine.sample.grammar_compiler import GrammarLimits
from graphcache.engine.sample.logprobs import PromptSpan, record_prompt_logprobs, record_sampled_logprobs
from graphcache.engine.sample.structured import StructuredOutput
from graphcache.engine.sched.block_manager import BlockManager
from graphcache.engine.sched.scheduler import Scheduler, SchedulerOutput
from graphcache.engine.sequence import RequestOutput, SamplingParams, Sequence
from graphcache.engine.spec.acceptance import AcceptanceGate, AcceptanceRule
from graphcache.engine.spec.build import build_proposer
from graphcache.engine.spec.config import parse_speculative_config
from graphcache.engine.spec.metrics import SpecDecodeMetrics
from graphcache.engine.spec.payoff import StepPayoff
from graphcache.engine.spec.proposer import Proposer
from graphcache.kv_events.config import parse_kv_events_config
from graphcache.kv_events.publisher import make_publisher
from graphcache.kv_events.recorder import KVEventRecorder
from graphcache.metrics import Metrics

__all__ = ["EngineCore"]

log = logging.getLogger("graphcache.engine")


def _needs_host_history(params: SamplingParams) -> bool:
    """Whether sampling this request reads its previous tokens on the host (the sampler's history-dependent
    controls, or a grammar whose matcher must have accepted the last token before the next mask): then
    its next step must not be launched before the last one's tokens are appended (no overlap)."""
    return needs_history(params) or params.structured is not None


# The payoff rule's step seconds: a wait this long between a completion and the next scheduling is an idle
# engine (no step leaves the host busy that long between two steps), not the next step's cost.
IDLE_GAP_S = 0.05


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are not on the host yet."""

    plan: SchedulerOutput
    out: StepOutput  # its ids, logprobs and their host copies (valid once out.ready is done)
    sample_seqs: list[Sequence]  # the sequences of its sampled rows, in the order of its ids
    launched_at: float
    scheduled_at: float  # perf_counter when schedule() began (the step trace)
    needs_history: bool = False  # a sampled sequence's next sampling reads these tokens on the host
    launch_end: float = 0.0  # perf_counter when _launch returned (the step trace)


class EngineCore:
    def __init__(
        self,
        runner: Runner,
        settings: Settings,
        metrics: Metrics | None = None,
        *,
        proposer: Proposer | None = None,
    ) -> None:
        """proposer: the drafts' source when --speculative-config names one the engine builds beside the
        runner (a draft model: engine/worker/draft_model.py); None: build_proposer's (n-gram)."""
        self.runner = runner
        self.settings = settings
        self.metrics = metrics
        self.block_manager = BlockManager(
            runner.num_kv_blocks,
            runner.block_size,
            enable_prefix_caching=settings.engine.enable_prefix_caching,
        )
        # --kv-events-config: the block manager's stores and evictions, published after each step.
        self.kv_events = make_publisher(parse_kv_events_config(settings.engine.kv_events_config))
        if self.kv_events is not None:
            self.block_manager.events = KVEventRecorder(runner.block_size, self.kv_events.publish)
        self._prefix_counted = (0, 0)  # block-manager lookup counters already added to the metrics
        self._recomputed_counted = 0  # scheduler.num_recomputed_tokens already added to the metrics
        bm = self.block_manager  # the limits never change after load: one snapshot checks every request
        self.checker = RequestChecker(
            EngineLimits(runner.vocab_size, runner.max_model_len, bm.block_size, bm.num_usable),
            runner.tokenizer,
            GrammarLimits.from_settings(settings),
            metrics,
            grammar_cache=StructuredOutput,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=settings.engine.max_num_seqs,
            max_num_batched_tokens=settings.engine.max_num_batched_tokens,
            max_model_len=runner.max_model_len,
            eos_token_ids=runner.eos_token_ids,
            policy=settings.engine.scheduling_policy,
        )
        if settings.lora.enable_lora:
            self.scheduler.max_loras = settings.lora.max_loras
            if runner.lora is not None:  # the KV events name an adapter's blocks by its id
                self.block_manager.lora_ids = runner.lora.modules.lora_id
        # Speculative decoding (--speculative-config): the scheduler drafts with the proposer, the worker
        # verifies, postprocess appends the accepted run and rolls back; the vllm:spec_decode_* counters.
        self.spec = parse_speculative_config(settings.engine.speculative_config)
        self.spec_metrics: SpecDecodeMetrics | None = None
        if self.spec is not None:
            self.scheduler.spec = self.spec
            self.scheduler.proposer = proposer or build_proposer(self.spec, runner.max_model_len)
            if runner.device_type == "cuda":  # whole steps: verify rows must fit the verify graphs
                verify = [d.num_tokens for d in runner.warmup_descriptors() if d.verify]
                limit = self.spec.verify_batch_limit(max(verify, default=None))
                self.scheduler.spec_batch_limit = limit
                if limit is not None and self.spec.disable_by_batch_size is None:
                    log.info(
                        "speculative decoding: off in steps of %d or more running requests (their verify rows "
                        "outgrow the verify graphs); disable_by_batch_size sets another bound",
                        limit,
                    )
            eng = settings.engine
            if eng.speculative_step_payoff:  # whole steps by their measured payoff (engine/spec/payoff.py)
                self.scheduler.payoff = StepPayoff()
            # the turn-off rule by measured acceptance (engine/spec/acceptance.py)
            self.scheduler.acceptance = AcceptanceGate(
                AcceptanceRule.for_method(
                    self.spec.method,
                    eng.speculative_token_cost,
                    eng.speculative_judge_drafts,
                    eng.speculative_reprobe_steps,
                )
            )
            if metrics is not None:  # one collector per registry (a second core on it shares the first's)
                held = metrics.spec_decode
                if not isinstance(held, SpecDecodeMetrics) or held.num_speculative_tokens != (
                    self.spec.num_speculative_tokens
                ):
                    if isinstance(held, SpecDecodeMetrics):  # another k: its counters start over
                        metrics.registry.unregister(held)
                    held = metrics.spec_decode = SpecDecodeMetrics(
                        metrics.registry, metrics.vllm, self.spec.num_speculative_tokens
                    )
                self.spec_metrics = held
        self.requests: dict[str, Sequence] = {}  # unfinished requests, by id
        self.outputs = RequestOutputs(metrics)
        # Unfinished requests whose sampling reads their history on the host (_needs_host_history): a set,
        # so a step without any costs nothing per row.
        self._history_seqs: set[Sequence] = set()
        self.num_steps = 0
        self.steps_by_mode: dict[str, int] = {}
        self.consecutive_failures = 0
        mode = settings.engine.async_scheduling
        self.async_scheduling = mode == "on" or (mode == "auto" and runner.device_type == "cuda")
        self._pending: _InFlight | None = None
        # Host seconds spent per phase of step() (schedule, execute = the runner's layout + launch/replay +
        # sampling launch, sample = waiting for the GPU's ids, postprocess = append/stops/outputs):
        # benchmarks read them.
        self.phase_seconds = dict.fromkeys(("schedule", "execute", "sample", "postprocess"), 0.0)
        # settings.engine.step_trace: per completed step, (schedule start, launch start, launch end, completion
        # start, tokens on the host, completion end) as perf_counter seconds, then rows scheduled, tokens
        # fed, rows sampled, waiting, running, context (the KV positions the rows attend to: one sum over the
        # rows' starts). Bounded: a long-running server keeps the newest.
        self.step_trace: deque[tuple] | None = (
            deque(maxlen=STEP_TRACE_MAX) if settings.engine.step_trace else None
        )
        self._last_done = 0.0  # perf_counter of the last step's completion (the payoff rule's clock)
        # Test hook: called with each StepPlan before execute; raise to fail the step.
        self.step_failpoint: Callable[[StepPlan], None] | None = None

    # --- requests ------------------------------------------------------------------------
    def check(self, seq: Sequence, param: str = "max_tokens") -> None:
        """Raise InvalidRequest naming the fix when `seq` can never be served; resolves max_tokens
        (engine/loop/request_check.py: the one check, shared with the API process's EngineClient)."""
        self.checker.check(seq, param)

    def add_request(self, seq: Sequence) -> None:
        """Queue a checked sequence (see check()). Its detokenizer is made here."""
        if seq.request_id in self.requests:
            raise InvalidRequest(f"request id {seq.request_id!r} is already in flight; use a unique id")
        tokenizer = self.runner.tokenizer
        # A stream without stop strings needs no text here: its consumer detokenizes (Engine._stream,
        # off the step loop, several tokens per call when it falls behind); its outputs carry ids only.
        # An embedding request (params.pooling) has no text at all.
        if tokenizer is not None and seq.params.pooling is None and not (seq.stream and not seq.params.stop):
            seq.detokenizer = tokenizer.detokenizer(
                seq.prompt_token_ids, seq.params.stop, seq.params.skip_special_tokens
            )
            # Non-streaming and no stop strings: nobody reads text before the end.
            seq.defer_text = not seq.stream and not seq.params.stop
        if seq.params.structured is not None:
            seq.grammar = self.structured.new_matcher(seq.params.structured, seq.compiled_grammar)
            seq.compiled_grammar = None
            self.scheduler.grammar_masks = self.structured.masks  # the plans carry the grammar rows' masks
        self.requests[seq.request_id] = seq
        if _needs_host_history(seq.params):
            self._history_seqs.add(seq)
        self.scheduler.add(seq)

    @property
    def structured(self) -> StructuredOutput:
        """The grammar engine over this model's tokenizer (built lazily: ~1 s for a 150k vocabulary)."""
        structured = self.checker.structured
        assert isinstance(structured, StructuredOutput)  # this core's checker builds StructuredOutput
        return structured

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
        """End a request wherever it is (its blocks are freed at once); its final output, or None if unknown."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, reason, error)
        return self._output(seq)

    def abort_all(self, reason: str, error: str | None = None) -> list[RequestOutput]:
        return [out for rid in list(self.requests) if (out := self.abort(rid, reason, error)) is not None]

    # --- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of every request it advanced or ended. Raises EngineFailure.

        Async scheduling: the step is launched (inputs uploaded, graph replayed, tokens sampled on
        the device, their copy to the host queued), then the step launched before it is completed
        (wait for its tokens, postprocess): the host schedules and prepares step n+1 while the GPU
        runs step n. A decode fed step n's token gets it on the device (a placeholder input). A
        sequence that step n finished drops what step n+1 computed for it."""
        outputs: list[RequestOutput | None] = []
        if self._pending is not None and self._pending.needs_history:
            outputs += self._complete_pending()  # its tokens feed the next sampling on the host: no overlap
        t_start = time.perf_counter()
        plan = self.scheduler.schedule()
        outputs += [self._output(seq) for seq in plan.failed]
        for seq in plan.failed:
            log.warning("request %s cannot fit: %s", seq.request_id, seq.error)
        if plan.preempted and self.metrics is not None:
            self.metrics.preemptions.inc(len(plan.preempted))
        t_scheduled = time.perf_counter()
        self.phase_seconds["schedule"] += t_scheduled - t_start
        launched = None
        if not plan.empty:
            try:
                launched = self._launch(plan, t_start)
            except Exception as exc:
                early = outputs + self._complete_pending()  # the step in flight still ends properly
                try:
                    return [o for o in early if o is not None] + self._step_failed(plan, exc)
                except EngineFailure as failure:
                    failure.outputs[:0] = [o for o in early if o is not None]
                    raise
            self.phase_seconds["execute"] += time.perf_counter() - t_scheduled
        outputs += self._complete_pending()
        self._pending = launched
        if not self.async_scheduling:
            outputs += self._complete_pending()
        self.flush_kv_events()
        return [o for o in outputs if o is not None]

    def flush_kv_events(self) -> None:
        """Publish the KV cache events since the last flush (after a step; between steps for aborts)."""
        if self.block_manager.events is not None:
            self.block_manager.events.flush()

    def close(self) -> None:
        """Stop publishing KV cache events (what is queued is sent first, briefly)."""
        if self.kv_events is not None:
            self.kv_events.close()

    def has_work(self) -> bool:
        return self._pending is not None or self.scheduler.has_work()

    def _launch(self, plan: SchedulerOutput, scheduled_at: float = 0.0) -> _InFlight:
        """Execute the plan's step (the worker samples it on the device); nothing waits for the GPU."""
        step = plan.plan
        assert step is not None  # schedule() builds it whenever a row is scheduled
        if self.step_failpoint is not None:
            self.step_failpoint(step)
        t0 = time.perf_counter()
        out = self.runner.execute(step)
        sample_seqs = plan.sampled
        history = self._history_seqs
        needs_history = bool(history) and not history.isdisjoint(sample_seqs)
        sched = self.scheduler
        if step.verify:
            # A verify row emits 1..k+1 tokens and its K/V counts its drafts until they are verified: the
            # next step can be planned only once the run has landed (never overlapped, whatever the batch
            # size or the acceptance gate now say about the next step).
            needs_history = True
        elif not needs_history and sched.proposer is not None and sched.speculates_next(len(sample_seqs)):
            # The proposer drafts from a row's tokens on the host: a row that may speculate next step is
            # not overlapped (async scheduling is off for the steps of speculating requests).
            needs_history = any(map(sched.drafts_next, sample_seqs))
        return _InFlight(plan, out, sample_seqs, t0, scheduled_at, needs_history, time.perf_counter())

    def _complete_pending(self) -> list[RequestOutput]:
        """Wait for the step in flight (if any), append its tokens, check stops: its outputs."""
        p, self._pending = self._pending, None
        if p is None:
            return []
        t0 = time.perf_counter()
        result = p.out
        try:
            if result.ready is not None:
                result.ready.synchronize()
            tokens: list = result.host.tolist()
            verified = None
            if result.spec_tokens is not None:
                verified = (result.spec_tokens.tolist(), result.spec_accepted.tolist())
        except Exception as exc:
            return self._step_failed(p.plan, exc)
        num_generated = len(tokens)
        if verified is not None:
            num_generated += self._merge_verified(p.plan, tokens, *verified)
        for i in result.failed:
            tokens[i] = None
            num_generated -= 1
        if result.pooled_keys:  # embedding requests: their vector is their answer, the row's token is dropped
            num_generated -= self._record_pooled(p.sample_seqs, result)
        t_done = time.perf_counter()
        self._observe_payoff(p, num_generated, t_done)
        self.consecutive_failures = 0
        self.num_steps += 1
        self.steps_by_mode[result.mode] = self.steps_by_mode.get(result.mode, 0) + 1
        now = time.monotonic()
        lp_seqs = [p.sample_seqs[i] for i in result.logprob_rows]
        lengths = [seq.num_output_tokens for seq in lp_seqs]
        changed = self.scheduler.postprocess(p.plan, tokens, now)
        if result.logprobs is not None:
            record_sampled_logprobs(
                lp_seqs, lengths, [tokens[i] for i in result.logprob_rows], result.logprobs
            )
        if result.prompt_logprobs is not None:
            record_prompt_logprobs(self._prompt_spans(p.plan), result.prompt_logprobs)
        m = self.metrics
        if m is not None:
            m.steps.labels(result.mode).inc()
            m.step_seconds.labels(result.mode).observe(t_done - p.launched_at)
            m.batch_size.observe(len(p.plan.seqs))
            m.generation_tokens.inc(num_generated)
            m.vllm.observe_step(p.plan.num_tokens)
            for seq in changed:
                first = len(seq.output_token_ids) == 1 or seq.embedding is not None  # first token or vector
                if first and seq.first_token_time == now:
                    m.ttft.observe(now - seq.arrival_time)
                    m.vllm.observe_first_token(now - seq.arrival_time)
                    m.prompt_tokens.inc(seq.num_prompt_tokens)
                    m.vllm.observe_prompt(seq.num_prompt_tokens, seq.num_cached_tokens)
        outputs = [out for seq in changed if (out := self._output(seq)) is not None]
        t_end = time.perf_counter()
        self.phase_seconds["sample"] += t_done - t0
        self.phase_seconds["postprocess"] += t_end - t_done
        if self.step_trace is not None:
            plan, sched = p.plan, self.scheduler
            self.step_trace.append(
                (
                    p.scheduled_at,
                    p.launched_at,
                    p.launch_end,
                    t0,
                    t_done,
                    t_end,
                    len(plan.seqs),
                    plan.num_tokens,
                    len(p.sample_seqs),
                    len(sched.waiting),
                    len(sched.running),
                    sum(plan.starts) + plan.num_tokens,
                )
            )
        return outputs

    def _observe_payoff(self, p: _InFlight, emitted: int, t_done: float) -> None:
        """Report a completed step with no prompt chunk to the payoff rule (engine/spec/payoff.py). Its
        seconds run from the previous completion, so the host's work between a step that does not overlap
        the next and that next step counts; a gap of IDLE_GAP_S before its scheduling was an idle engine."""
        payoff, step, last = self.scheduler.payoff, p.plan.plan, self._last_done
        self._last_done = t_done
        if payoff is None or step is None:
            return
        since = p.scheduled_at if p.scheduled_at - last > IDLE_GAP_S else last
        rows = step.num_reqs
        if step.num_tokens == rows + sum(n for _, n in step.verify):  # decode and verify rows only
            payoff.observe(rows, p.plan.speculated, emitted, t_done - since)

    def _merge_verified(
        self, plan: SchedulerOutput, tokens: list, spec_tokens: list[list[int]], accepted: list[int]
    ) -> int:
        """Replace each verify row's sampled id by its emitted run (accepted drafts + the last token),
        observe the spec-decode counters; returns the extra tokens emitted."""
        step = plan.plan
        assert step is not None
        need = step.need_logits
        sampled_index = list(range(len(step.keys))) if need is None else list(accumulate(need, initial=0))
        extra = 0
        for (row, _), run, a in zip(step.verify, spec_tokens, accepted, strict=True):
            tokens[sampled_index[row]] = run[: a + 1]
            extra += a
        if self.spec_metrics is not None:
            self.spec_metrics.observe([n for _, n in step.verify], accepted)
        return extra

    @staticmethod
    def _record_pooled(sample_seqs: list[Sequence], result: StepOutput) -> int:
        """Put each pooled vector on its sequence (cut to its dimensions: the rest are zeros); returns
        how many rows pooled."""
        by_key = {seq.key: seq for seq in sample_seqs}
        for key, vector in zip(result.pooled_keys, result.pooled.tolist(), strict=True):
            seq = by_key[key]
            spec = seq.params.pooling
            seq.embedding = vector[: spec.dimensions] if spec is not None and spec.dimensions else vector
        return len(result.pooled_keys)

    @staticmethod
    def _prompt_spans(plan: SchedulerOutput) -> list[PromptSpan]:
        """Where the step's prompt logprobs go: each PromptLogits row's sequence and first entry."""
        assert plan.plan is not None  # a completed step was launched with its plan
        return [
            PromptSpan(plan.seqs[p.row], plan.starts[p.row] + p.offset + 1, p.targets)
            for p in plan.plan.prompt_logits
        ]

    def _step_failed(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        self.consecutive_failures += 1
        if (
            plan.plan is not None
        ):  # the keys it dropped may not have reached the worker: the next plan says them again
            self.scheduler.dropped.extend(plan.plan.finished)
        ids = [seq.request_id for seq in plan.seqs]
        log.error(
            "step failed (%d in a row) for requests %s: %s: %s",
            self.consecutive_failures,
            ids,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        outputs = []
        for seq in plan.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error", STEP_FAILED_MESSAGE)
                outputs.append(self._output(seq))
        if is_device_failure(exc) or self.consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineFailure(
                f"{self.consecutive_failures} failed steps in a row, last: {type(exc).__name__}: {exc}",
                [o for o in outputs if o is not None],
            ) from exc
        return [o for o in outputs if o is not None]

    # --- outputs ---------------------------------------------------------------------------
    def _output(self, seq: Sequence) -> RequestOutput | None:
        """What `seq` has not streamed yet (None: nothing to send now); on finish, retire it."""
        if seq.is_finished:
            self.requests.pop(seq.request_id, None)
            self._history_seqs.discard(seq)
        return self.outputs.output(seq)

    def stream_outputs(self) -> list[RequestOutput]:
        """The outputs of every stream that got tokens since its last output (the Engine calls this
        at most every stream_interval_ms; a final output always carries what was not sent)."""
        return self.outputs.stream_outputs()

    # --- state for gauges and stats --------------------------------------------------------
    def update_gauges(self) -> None:
        if self.metrics is not None:
            bm = self.block_manager  # prefix-cache lookups (tokens) since the last update
            queried, hit = bm.prefix_cache_queries, bm.prefix_cache_hits
            self.metrics.prefix_cache_queries.inc(queried - self._prefix_counted[0])
            self.metrics.prefix_cache_hits.inc(hit - self._prefix_counted[1])
            self._prefix_counted = (queried, hit)
            recomputed = self.scheduler.num_recomputed_tokens
            self.metrics.vllm.observe_recomputed(recomputed - self._recomputed_counted)
            self._recomputed_counted = recomputed
            self.metrics.requests_running.set(len(self.scheduler.running))
            self.metrics.requests_waiting.set(len(self.scheduler.waiting))
            self.metrics.kv_usage.set(self.block_manager.usage)
            if self.settings.lora.enable_lora:
                record_lora_gauges(self.runner.lora, self.scheduler, self.metrics)
            if not self.metrics.vllm.cache_config:  # vllm:cache_config_info: the KV cache's shape, once
                bm = self.block_manager
                self.metrics.vllm.set_cache_config(
                    block_size=bm.block_size,
                    num_gpu_blocks=bm.num_blocks,
                    cache_dtype=(
                        "fp8_e4m3"
                        if self.settings.model.kv_cache_dtype != "auto"
                        else str(self.runner.dtype).removeprefix("torch.")
                    ),
                )

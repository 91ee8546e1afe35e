"""DraftModelProposer: speculative drafts from a smaller model with the target's tokenizer
(`--speculative-config '{"method": "draft_model", "model": ..., "num_speculative_tokens": k}'`).

It is a host `Proposer` (engine/spec/proposer.py) to the scheduler: `propose(requests, limits)` returns
token lists, so the verify step, rejection sampling, rollback and the metrics stay as they are. Inside,
the draft runs on the device through a `ModelRunner` of its own (engine/worker/runner.py): its own
weights, its own paged KV cache (as many blocks as the target's: the target's sizing counted them,
engine/worker/draft_memory.py), its own static buffers and its own GraphCache, so its steps are
descriptors captured, replayed, counted and evicted like the target's. It runs on the engine thread
(the scheduler calls it there).

Per request it keeps the token ids whose K/V its cache holds (`held`) and its own block list. A propose:
  1. keeps the longest common prefix of `held` and the request's accepted context (prompt + output):
     that is the rollback. Rejected drafts past it are overwritten by the next write; attention never
     reads past a row's length;
  2. feeds the rest in one batched extend step (a request's first call: its whole context), chunked
     under the draft's token budget with every row's last chunk in the final step, which samples d1;
  3. runs k - 1 batched one-token decode steps, each fed the token the step before it sampled, on the
     device (the plan's rows are "the token in flight", as async scheduling feeds the target), and
     reads the k drafts of every row back with one copy at the end.
Drafting is greedy (the argmax of the draft's logits): a one-hot proposal, which the rejection sampler
verifies exactly for greedy and sampled target rows alike.

Blocks: a request's blocks are allocated when it needs them and go back on remove (finish, abort,
preemption: the scheduler calls remove). A request that finds no free block gets no draft that step (it
decodes plainly); the draft never takes blocks from another request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphcache.config import Settings
from graphcache.engine.plan import NewRequest, Runner, StepPlan
from graphcache.engine.sequence import SamplingParams
from graphcache.engine.spec.config import SpeculativeConfig, parse_speculative_config
from graphcache.engine.spec.proposer import DraftRequest, Proposer
from graphcache.engine.worker.draft_memory import draft_settings, weight_elements
from graphcache.engine.worker.runner import ModelRunner
from graphcache.graphs.cache import WarmupReport
from graphcache.metrics import GraphCacheMetrics, Metrics
from graphcache.model.source import fetch_hub_model, model_source

__all__ = ["DraftModelProposer", "DraftVocabMismatch", "build_draft_proposer", "fetch_draft_model"]

log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)


class DraftVocabMismatch(ValueError):
    """The draft model's tokenizer is not the target's: its token ids would mean other text."""


@dataclass(slots=True)
class _Held:
    """One request the draft holds: the ids whose K/V its cache has (positions 0..len - 1) and its blocks."""

    key: int
    held: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    known: bool = False  # the draft runner holds it (a NewRequest went out)
    sent: int = 0  # blocks[:sent] are in the draft runner's table
    synced: int = 0  # context tokens already compared: context[:synced] == held[:synced]


@dataclass(slots=True)
class _Row:
    """One row of a propose: what it feeds, from where, and how many drafts it may take."""

    index: int  # its place in propose()'s arguments
    state: _Held
    start: int  # position of feed[0] (= tokens the draft's cache keeps)
    feed: list[int]  # context ids past the kept prefix (at least the last one)
    limit: int  # drafts wanted (1..k)


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, target_vocab_size: int) -> None:
        """runner: the draft's own ModelRunner (its KV cache, buffers and graph cache); drafts with an id
        at or past target_vocab_size (a draft's padded vocabulary rows) end a row's draft there."""
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.target_vocab_size = target_vocab_size
        self.block_size = runner.block_size
        self._states: dict[str, _Held] = {}
        self._free: list[int] = list(range(runner.num_kv_blocks - 1, -1, -1))  # a stack: low ids first
        self._dropped: list[int] = []  # keys the draft runner drops with the next plan
        self._next_key = 0
        self.num_steps = 0  # draft steps run (extend and decode), for tests and logs
        self.num_no_room = 0  # rows that got no draft for want of a free KV block
        self.num_failures = 0  # proposes whose draft steps raised (those rows decoded plainly)

    @classmethod
    def load(
        cls,
        settings: Settings,
        config: SpeculativeConfig,
        *,
        target_tokenizer,
        target_vocab_size: int,
        num_kv_blocks: int,
        max_model_len: int,
        metrics: GraphCacheMetrics | None = None,
    ) -> DraftModelProposer:
        """Load the draft named by config.model (a local directory: the engine fetched a hub id) beside a
        target with `num_kv_blocks` blocks and `max_model_len`; refuses a tokenizer other than the target's.
        metrics: the series the draft's graph cache records to (the draft's own: Metrics.draft_graph_metrics)."""
        s = draft_settings(settings, config, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len)
        runner = ModelRunner(s, metrics)
        check_same_vocabulary(target_tokenizer, runner.tokenizer, str(config.model))
        log.info(
            "draft model %s: %d KV blocks, %d speculative tokens per step",
            runner.model_path,
            runner.num_kv_blocks,
            config.num_speculative_tokens,
        )
        return cls(runner, config.num_speculative_tokens, target_vocab_size)

    # --- the Proposer contract ---------------------------------------------------------------------
    def propose(
        self, requests: Sequence[DraftRequest], max_draft_tokens: Sequence[int] | None = None
    ) -> list[list[int]]:
        k = self.num_speculative_tokens
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[_Row] = []
        for i, req in enumerate(requests):
            limit = k if max_draft_tokens is None else min(k, max_draft_tokens[i])
            if limit <= 0:
                continue
            row = self._row(i, req, limit)
            if row is not None:
                rows.append(row)
        # one step holds every row's last chunk: rows past the draft's buffers get no draft this time
        rows = rows[: min(self.runner.max_tokens, self.runner.max_reqs)]
        if not rows:
            return drafts
        try:
            ids = self._draft(rows)
        except Exception:
            # The target serves on without drafts this step (a device fault fails its own next step,
            # where the engine handles it); the draft's cache may hold half a step: every request
            # starts over.
            self._forget_all()
            self.num_failures += 1
            if self.num_failures == 1 or self.num_failures % 1000 == 0:
                log.exception(
                    "draft model step failed (%d so far); these rows decode plainly", self.num_failures
                )
            return drafts
        for row, got in zip(rows, ids, strict=True):
            cut = next((j for j, t in enumerate(got) if t >= self.target_vocab_size), len(got))
            drafts[row.index] = got[:cut]
            # the cache now holds the context and every draft but the last (never fed)
            row.state.held = row.state.held[: row.start] + row.feed + got[: row.limit - 1]
            row.state.synced = row.start + len(row.feed)
        return drafts

    def remove(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is None:
            return
        self._free.extend(reversed(state.blocks))
        if state.known:
            self._dropped.append(state.key)

    def retain(self, request_ids: Iterable[str]) -> None:
        keep = set(request_ids)
        for rid in [r for r in self._states if r not in keep]:
            self.remove(rid)

    # --- warmup and inspection -------------------------------------------------------------------
    def warmup(self) -> WarmupReport:
        """Capture the draft's warmup descriptors (the settings' decode sizes: its k - 1 decode steps)."""
        return self.runner.warmup()

    def info(self) -> dict[str, Any]:
        """The draft model's state for /admin/cache ("draft"): its graph cache, and what it holds and did."""
        return {
            **self.runner.cache.info(),
            "proposer": {
                "model": str(self.runner.model_path),
                "num_speculative_tokens": self.num_speculative_tokens,
                "requests": self.held_requests,
                "kv_blocks": self.runner.num_kv_blocks,
                "kv_blocks_free": self.num_free_blocks,
                "steps": self.num_steps,
                "rows_without_room": self.num_no_room,
                "failures": self.num_failures,
            },
        }

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def held_requests(self) -> int:
        return len(self._states)

    # --- one propose -----------------------------------------------------------------------------
    def _row(self, index: int, req: DraftRequest, limit: int) -> _Row | None:
        """The row of `req`: its kept prefix and what it feeds, with the blocks its drafts need (None: no
        free block; the request keeps what it holds)."""
        state = self._states.get(req.request_id)
        if state is None:
            state = self._states[req.request_id] = _Held(self._new_key())
        prompt, output = req.prompt_token_ids, req.output_token_ids
        num_prompt = len(prompt)
        n = num_prompt + len(output)
        held = state.held
        # The context only grows while a request runs: compare from where the last call's context ended.
        p = min(state.synced, len(held), n - 1)
        tail = _tail(prompt, output, p)
        stop = min(len(held), n - 1)
        j = 0
        while p + j < stop and held[p + j] == tail[j]:
            j += 1
        p += j
        feed = tail[j:]
        # K/V slots up to position n + limit - 2 (the last context token and limit - 1 drafts are fed)
        need = -(-(n + limit - 1) // self.block_size) - len(state.blocks)
        if need > len(self._free):
            self.num_no_room += 1
            return None
        state.blocks += [self._free.pop() for _ in range(max(need, 0))]
        return _Row(index, state, p, feed, limit)

    def _draft(self, rows: list[_Row]) -> list[list[int]]:
        """Run the extend step(s) and the decode steps of `rows`; each row's drafts (up to its limit)."""
        runner = self.runner
        budget = runner.max_tokens
        new = tuple(
            NewRequest(r.state.key, f"draft-{r.state.key}", [], [], GREEDY, list(r.state.blocks))
            for r in rows
            if not r.state.known
        )
        grown = tuple(
            (r.state.key, r.state.blocks[r.state.sent :])
            for r in rows
            if r.state.known and r.state.sent < len(r.state.blocks)
        )
        for r in rows:
            r.state.known, r.state.sent = True, len(r.state.blocks)
        dropped, self._dropped = tuple(self._dropped), []
        # The final extend step feeds every row's last chunk (each row samples there: the decode steps
        # after it read those ids on the device); what does not fit goes in chunks before it.
        tails = _final_chunks([len(r.feed) for r in rows], budget)
        first = True
        pending = [(r, 0, len(r.feed) - t) for r, t in zip(rows, tails, strict=True) if len(r.feed) > t]
        while pending:
            take, left, room = [], [], budget
            for r, lo, hi in pending:
                n = min(hi - lo, room)
                if n > 0:
                    take.append((r, lo, lo + n))
                    room -= n
                if lo + n < hi:
                    left.append((r, lo + n, hi))
            plan = StepPlan(
                keys=[r.state.key for r, _, _ in take],
                starts=[r.start + lo for r, lo, _ in take],
                tokens=[r.feed[lo:hi] for r, lo, hi in take],
                need_logits=[False] * len(take),
                **self._changes(first, new, grown, dropped),
            )
            first = False
            runner.execute(plan)
            self.num_steps += 1
            pending = left
        starts = [r.start + len(r.feed) - t for r, t in zip(rows, tails, strict=True)]
        plan = StepPlan(
            keys=[r.state.key for r in rows],
            starts=starts,
            tokens=[r.feed[len(r.feed) - t :] for r, t in zip(rows, tails, strict=True)],
            need_logits=[True] * len(rows),
            **self._changes(first, new, grown, dropped),
        )
        sampled = [runner.execute(plan).sampled.clone()]  # [B] the first draft of every row
        self.num_steps += 1
        # Decode steps: row r's j-th draft (j >= 1) from its (j - 1)-th, fed on the device.
        live = list(range(len(rows)))
        positions = [r.start + len(r.feed) for r in rows]  # where each row's next fed token goes
        for j in range(1, max(r.limit for r in rows)):
            live = [b for b in live if rows[b].limit > j]
            plan = StepPlan(
                keys=[rows[b].state.key for b in live], starts=[positions[b] + j - 1 for b in live]
            )
            sampled.append(runner.execute(plan).sampled.clone())
            self.num_steps += 1
        host = torch.cat(sampled).tolist()  # the one wait for the device in a propose
        out: list[list[int]] = [[] for _ in rows]
        at = 0
        live = list(range(len(rows)))
        for j, ids in enumerate(sampled):
            live = [b for b in live if rows[b].limit > j]
            for b, t in zip(live, host[at : at + len(live)], strict=True):
                out[b].append(t)
            at += ids.numel()
        return out

    @staticmethod
    def _changes(first: bool, new: tuple, grown: tuple, dropped: tuple) -> dict:
        """The table changes a propose sends with its first step only."""
        return {"new": new, "grown": grown, "finished": dropped} if first else {}

    def _new_key(self) -> int:
        self._next_key += 1
        return self._next_key

    def _forget_all(self) -> None:
        """Drop every request's state (a failed draft step): their blocks come back, their keys are dropped."""
        for rid in list(self._states):
            self.remove(rid)


def _tail(prompt: Sequence[int], output: Sequence[int], start: int) -> list[int]:
    """(prompt + output)[start:], without copying the part before start."""
    num_prompt = len(prompt)
    if start >= num_prompt:
        return list(output[start - num_prompt :])
    return list(prompt[start:]) + list(output)


def _final_chunks(lengths: list[int], budget: int) -> list[int]:
    """How many of each row's fed tokens the final extend step takes: at least one each, the rest of the
    budget handed out in row order."""
    tails = [1] * len(lengths)
    room = budget - len(lengths)
    for i, n in enumerate(lengths):
        extra = min(n - 1, max(room, 0))
        tails[i] += extra
        room -= extra
    return tails


def check_same_vocabulary(target, draft, name: str) -> None:
    """Raise DraftVocabMismatch unless the draft's tokenizer maps tokens to the target's ids."""
    if target is None or draft is None:
        return
    t_vocab, d_vocab = target.vocabulary(), draft.vocabulary()
    if t_vocab != d_vocab:
        differ = len(set(t_vocab.items()) ^ set(d_vocab.items()))
        raise DraftVocabMismatch(
            f"speculative_config.model {name!r}: its tokenizer differs from the target's ({len(d_vocab)} "
            f"vs {len(t_vocab)} tokens, {differ} entries differ); name a draft model of the target's family "
            "with the same tokenizer, or use method ngram"
        )


# --------------------------------------------------------------------------- the engine's part


def fetch_draft_model(settings: Settings, on_progress: Callable[[dict[str, Any]], None]) -> Settings:
    """The settings with a draft model named by hub id fetched into the Hugging Face cache, as the target
    is (model/source.py), and speculative_config.model replaced by its snapshot directory; as they are
    otherwise. on_progress gets /ready's body while it downloads."""
    spec = parse_speculative_config(settings.engine.speculative_config)
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return settings
    source = model_source(spec.model)
    if not source.is_hub:
        return settings
    repo = source.repo_id
    assert repo is not None
    on_progress({"phase": "downloading", "model": repo, "draft": True})
    folder = fetch_hub_model(
        repo,
        None,
        lambda report: on_progress({"phase": "downloading", "model": repo, "draft": True, **report}),
    )
    raw = json.loads(settings.engine.speculative_config or "{}")
    raw["model"] = str(folder)
    return settings.updated(speculative_config=json.dumps(raw))


def build_draft_proposer(
    settings: Settings, target: Runner, metrics: Metrics | None = None
) -> DraftModelProposer | None:
    """The draft-model proposer the settings configure beside `target` (None: no draft model); its graph
    cache records to the `graphcache_draft_graph_*` series of `metrics`. Raises naming the fix: tensor
    parallelism (the draft runs in one process), a tokenizer other than the target's."""
    spec = parse_speculative_config(settings.engine.speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    if settings.model.tensor_parallel_size > 1:
        raise RuntimeError(
            'speculative_config.method "draft_model" runs with tensor_parallel_size 1 only (the draft model '
            "would need its own sharded ranks); set --tensor-parallel-size 1 or use method ngram"
        )
    assert spec.model is not None
    target_size, draft_size = weight_elements(Path(str(target.model_path))), weight_elements(Path(spec.model))
    if draft_size > target_size:
        log.warning(
            "draft model %s has %d weights, the target %d: drafting costs as much as decoding or more, so "
            "speculation is unlikely to pay; pick a smaller draft of the same family",
            spec.model,
            draft_size,
            target_size,
        )
    return DraftModelProposer.load(
        settings,
        spec,
        target_tokenizer=target.tokenizer,
        target_vocab_size=target.vocab_size if target.vocab_size is not None else 1 << 62,  # None: unchecked
        num_kv_blocks=target.num_kv_blocks,
        max_model_len=target.max_model_len,
        metrics=None if metrics is None else metrics.draft_graph_metrics(),
    )

"""AcceptanceGate: a request stops speculating once its measured acceptance makes drafts cost more than they
save, and is probed again now and then.

The cost model. A plain decode step emits one token a row. A verify step of k drafts costs about
(1 + c*k) decode steps, where c (`token_cost`, settings.engine.speculative_token_cost) is what one draft
token adds: scoring it in the verify step, and drafting it where drafting runs on the device (a draft
model's step). It emits accepted + 1 tokens. So drafting pays when accepted + 1 > 1 + c*k, i.e. when
accepted > c*k; summed over a request's recent verify steps: when its acceptance rate
(accepted / draft tokens) exceeds c. On the H200 a verify step of a few rows is bound by reading the
weights, as a decode step is, so c is small (docs/DEPLOY.md has the measured verify cost per k); a
request whose drafts are never accepted still pays c*k per step, the loss of the overlap of async
scheduling (the proposer reads its tokens on the host), and the proposer's host time.

The rule, per request (the scheduler owns one gate; rows are keyed by Sequence.key):
  - judge: once a request has carried drafts in `judge_drafts` verify steps (W) since it (re)started
    speculating, it is judged after each further one on its decayed counts (each step's weight falls by
    1 - 1/W, so the judgment follows the last ~W drafts: a request that copied a block of code and then
    writes new text turns off within ~W drafts, where cumulative counts would keep it on for as long as
    it had been copying);
  - off: accepted <= c * draft tokens (so c = 0 never turns a request off);
  - re-probe: an off request decodes plainly for R (`reprobe_steps`) steps, then speculates again with
    fresh counts and is judged after W drafts again. Text that starts repeating later (a quote, a list,
    code the answer copies from its prompt) turns it back on. A probe that fails doubles the wait, up to
    MAX_BACKOFF x R, so a request that never repeats costs at most W*c*k / (MAX_BACKOFF*R) of its steps
    in probes (W=8, c=0.1, k=4, R=64: 0.6%); a probe that pays resets the wait to R. Waits end on a
    multiple of R of the gate's clock, so many requests' probes fall on the same steps. R = 0: an off
    request stays off;
  - rest: W proposals in a row that found nothing (an n-gram proposer on text that does not repeat) put a
    request off the same way. Its empty proposals cost no verify work, but a request that may draft
    keeps its steps from overlapping the next under async scheduling (the proposer reads its tokens on
    the host), which at a large batch costs every row.
A step-level rule (all speculating rows below the threshold -> a plain decode step) adds nothing under
this linear model: the step's gain is the sum of its rows' (accepted - c*k), and each row that drafts has
passed its own test or is still being judged. Whole steps turn off by batch size (disable_by_batch_size).

No torch: the scheduler calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_TOKEN_COST", "MAX_BACKOFF", "AcceptanceGate", "AcceptanceRule"]

# c per proposer method when settings.engine.speculative_token_cost is unset. n-gram drafts cost host time
# only: c is the verify step's extra cost per token. A draft model also runs one draft step per token,
# at batch 1 about a quarter of a target's step for a 0.5B draft before an 8B target. Set from
# measurements (docs/DEPLOY.md, "Speculative decoding: measured costs").
DEFAULT_TOKEN_COST = {"ngram": 0.1, "draft_model": 0.3}
MAX_BACKOFF = 8  # a failed probe doubles the wait before the next one, up to this many times R


@dataclass(frozen=True)
class AcceptanceRule:
    """The gate's thresholds: c, W and R of the module docstring."""

    token_cost: float  # c: one draft token's cost, in plain decode steps
    judge_drafts: int = 8  # W: verify steps with drafts before a request is judged
    reprobe_steps: int = 64  # R: plain decode steps of an off request before it is probed (0: never)

    def __post_init__(self) -> None:
        if self.token_cost < 0 or self.judge_drafts < 1 or self.reprobe_steps < 0:
            raise ValueError(
                f"acceptance rule {self}: need token_cost >= 0, judge_drafts >= 1, reprobe_steps >= 0"
            )

    @classmethod
    def for_method(
        cls, method: str, token_cost: float | None, judge_drafts: int, reprobe_steps: int
    ) -> AcceptanceRule:
        """The rule of a configured method; token_cost None: DEFAULT_TOKEN_COST of the method."""
        cost = (
            DEFAULT_TOKEN_COST.get(method, max(DEFAULT_TOKEN_COST.values()))
            if token_cost is None
            else token_cost
        )
        return cls(cost, judge_drafts, reprobe_steps)


@dataclass(slots=True)
class _Row:
    """One request's measurements since it (re)started speculating, and when it may draft again."""

    drafts: int = 0  # verify steps in which it carried drafts
    draft_tokens: float = 0.0  # decayed sums
    accepted: float = 0.0
    empty: int = 0  # proposals in a row that found no draft
    until: int = -1  # -1: on; else the gate's step from which it drafts again (a probe)
    wait: int = 0  # the wait that put it off (a failed probe doubles it)
    probing: bool = False  # turned back on by a probe, not judged since


class AcceptanceGate:
    """Which requests draft this step, by their measured acceptance (module docstring). Engine thread only.

    The scheduler calls tick() once per step that may speculate, allows() once per such step for each
    request that may speculate, proposed() with each proposal's length, observe() with each verify row's
    result, and remove() when a request finishes."""

    def __init__(self, rule: AcceptanceRule) -> None:
        self.rule = rule
        self._decay = 1.0 - 1.0 / rule.judge_drafts
        self._rows: dict[int, _Row] = {}  # only requests that were proposed for: the rest are on
        self.now = 0  # the gate's clock: steps that may speculate
        self.num_turned_off = 0  # judgments that turned a request off (tests, logs)
        self.num_rested = 0  # requests put to rest after judge_drafts proposals in a row found nothing
        self.num_probes = 0  # off requests turned back on to be judged again

    def tick(self) -> None:
        self.now += 1

    def allows(self, key: int) -> bool:
        """Whether the request may draft in this step; an off request whose wait is over starts a probe."""
        row = self._rows.get(key)
        if row is None or row.until < 0:
            return True
        if self.now < row.until:
            return False
        row.until, row.drafts, row.draft_tokens, row.accepted, row.empty = -1, 0, 0.0, 0.0, 0
        row.probing = True
        self.num_probes += 1
        return True

    def wants(self, key: int) -> bool:
        """Whether the request drafts at the next step (allows() without side effects): the engine does not
        overlap a step of such a request, since the proposer reads its tokens on the host."""
        row = self._rows.get(key)
        return row is None or row.until < 0 or self.now + 1 >= row.until

    def is_on(self, key: int) -> bool:
        row = self._rows.get(key)
        return row is None or row.until < 0

    def proposed(self, key: int, num_tokens: int) -> None:
        """The proposer's draft for the request this step had `num_tokens` tokens. judge_drafts empty
        proposals in a row put it to rest like a turn-off: it costs no verify work, but a request that may
        draft keeps every step it runs in from overlapping the next (async scheduling), and the proposer's
        host time."""
        if self.rule.token_cost == 0:  # the rule is off
            return
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Row()
        if num_tokens:
            row.empty = 0
            return
        row.empty += 1
        if row.empty >= self.rule.judge_drafts:
            self._turn_off(row)
            self.num_rested += 1

    def observe(self, key: int, drafted: int, accepted: int) -> None:
        """One verify step of the request: `drafted` draft tokens scored, `accepted` of them accepted."""
        if drafted <= 0:
            return
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Row()
        decay = self._decay
        row.drafts += 1
        row.draft_tokens = row.draft_tokens * decay + drafted
        row.accepted = row.accepted * decay + accepted
        rule = self.rule
        if row.drafts < rule.judge_drafts:
            return
        if rule.token_cost == 0 or row.accepted > rule.token_cost * row.draft_tokens:  # pays: stay on
            if row.probing:
                row.probing, row.wait = False, 0
            return
        self._turn_off(row)
        self.num_turned_off += 1

    def _turn_off(self, row: _Row) -> None:
        """Off until a probe: R steps, doubled after a failed probe (up to MAX_BACKOFF x R), ending on a
        multiple of R so that the probes of many requests fall on the same steps (the steps in between
        overlap, under async scheduling)."""
        r = self.rule.reprobe_steps
        if r == 0:
            row.until = 1 << 62  # never probed again
        else:
            row.wait = min(2 * row.wait, MAX_BACKOFF * r) if row.probing and row.wait else r
            row.until = -(-(self.now + row.wait) // r) * r
        row.probing, row.empty = False, 0

    def remove(self, key: int) -> None:
        """Forget a finished request."""
        self._rows.pop(key, None)

    def __len__(self) -> int:
        return len(self._rows)

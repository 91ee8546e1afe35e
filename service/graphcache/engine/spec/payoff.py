"""StepPayoff: a step speculates only where steps that speculate have been measured to emit more tokens per
second than plain steps at the same batch size, on this server.

Why a step-level rule beside the acceptance gate (acceptance.py). The gate judges each request's acceptance
against a fixed cost per draft token. What a speculating step really costs depends on more than that: the
sampler (a sampled verify row builds the target's filtered distribution at each fed position), the host
(the proposer's time, and the overlap of async scheduling that a step whose rows may draft gives up), the
model's shape and the card. On an H100, realistic sampled traffic at the 0.5B shape spent 10.75 ms on an
all-verify step against 2.23 ms on a decode step: speculation halved the steps of the run's tail and still
lost a quarter of the throughput (BENCHMARKS.md §19). Rather than model each of these costs, this rule
measures their sum where it is paid.

The measure: a step's rate = tokens it emitted / (its seconds x its rows), for steps with no prompt chunk
(a prompt's cost is no one's speculation); its seconds run from the previous step's completion (or its own
scheduling, when that came later: after an idle engine) to its completion, so host time, waiting on the GPU
and lost overlap all count. A step "speculates" when this rule let it propose drafts, whether or not any
row got one: a step whose proposals came back empty still paid for trying.

The policy, per bucket of batch rows (1, 2, 3, 4, 6, 8, 12, ...: the rate per row changes with the rows):
  - a bucket starts speculating; once it has `min_samples` speculating steps it runs `probe_steps` plain
    steps in a row (a run, so the plain steps overlap as they do when speculation is off) to learn the
    plain rate;
  - with both rates known (exponentially weighted, `alpha`), an on bucket turns off once its speculating
    rate falls below (1 - `tolerance`) x its plain rate, and an off one turns on again once it is at least
    the plain rate. Why the tolerance: a speculating step whose proposals found nothing costs only the
    overlap it gave up, 2-4% of a step where the GPU bounds it (the 8B shape's buckets of 1-32 rows on an
    H100, BENCHMARKS.md §20); without it a bucket judged before its text starts repeating turned off, and
    probed rarely, while n-gram at one stream then ran 1.22x faster with speculation on. Where the host
    bounds the step the lost overlap costs far more than the tolerance, and the bucket still turns off;
  - on: every `probe_every` steps of the bucket a plain run refreshes the plain rate (the cost of
    watching: probe_steps / probe_every of the steps, 3% at the defaults);
  - off: after `wait` plain steps a run of speculating steps measures again; a run that still loses
    doubles the wait (up to `max_wait`), one that wins resets it.
Whole steps also turn off by batch size (config.py's disable_by_batch_size) before this rule is asked.

No torch: the scheduler asks it, the engine core reports each completed step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepPayoff", "rows_bucket"]


def rows_bucket(rows: int) -> int:
    """The bucket of a step of `rows` rows: rows rounded down to 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (two
    buckets per power of two)."""
    if rows <= 4:
        return max(rows, 1)
    power = 1 << (rows.bit_length() - 1)
    return power + power // 2 if rows >= power + power // 2 else power


@dataclass(slots=True)
class _Bucket:
    spec_rate: float = 0.0  # tokens per row-second of speculating steps (weighted mean)
    plain_rate: float = 0.0
    spec_n: int = 0  # speculating steps measured
    plain_n: int = 0
    on: bool = True  # speculates outside probes
    steps: int = 0  # decisions taken
    probe_left: int = 0  # steps left in the current probe run (the other mode than `on`)
    next_probe: int = 0  # `steps` at which the next probe run starts (0: when the rates ask for one)
    wait: int = 0  # off: plain steps before the next speculating probe run


class StepPayoff:
    def __init__(
        self,
        *,
        alpha: float = 0.25,
        tolerance: float = 0.05,
        min_samples: int = 4,
        probe_steps: int = 4,
        probe_every: int = 128,
        off_wait: int = 64,
        max_wait: int = 1024,
    ) -> None:
        if not (
            0 < alpha <= 1 and 0 <= tolerance < 1 and min_samples >= 1 and probe_every > probe_steps >= 1
        ):
            raise ValueError(
                "StepPayoff needs 0 < alpha <= 1, 0 <= tolerance < 1, min_samples >= 1, "
                "probe_every > probe_steps >= 1"
            )
        self.alpha, self.tolerance, self.min_samples = alpha, tolerance, min_samples
        self.probe_steps = probe_steps
        self.probe_every, self.off_wait, self.max_wait = probe_every, off_wait, max_wait
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, rows: int) -> _Bucket:
        key = rows_bucket(rows)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(wait=self.off_wait)
        return b

    def decide(self, rows: int) -> bool:
        """Whether the step about to be scheduled, with `rows` rows that could draft, speculates."""
        b = self._bucket(rows)
        b.steps += 1
        if b.probe_left == 0:
            learning = b.on and b.plain_n == 0 and b.spec_n >= self.min_samples
            if learning or (b.next_probe and b.steps >= b.next_probe):
                b.probe_left = self.probe_steps
                b.next_probe = 0
        if b.probe_left:
            b.probe_left -= 1
            return not b.on
        return b.on

    def would_speculate(self, rows: int) -> bool:
        """decide()'s likely answer for the next step (nothing advances): whether a row that may draft
        must keep its step from overlapping the next (engine core)."""
        b = self.buckets.get(rows_bucket(rows))
        return b is None or b.on != (b.probe_left > 0)

    def observe(self, rows: int, speculated: bool, emitted: int, seconds: float) -> None:
        """A completed step with no prompt chunk: `rows` rows, `emitted` tokens in `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        b, rate, a = self._bucket(rows), emitted / (seconds * rows), self.alpha
        if speculated:
            b.spec_rate = rate if b.spec_n == 0 else b.spec_rate + a * (rate - b.spec_rate)
            b.spec_n += 1
        else:
            b.plain_rate = rate if b.plain_n == 0 else b.plain_rate + a * (rate - b.plain_rate)
            b.plain_n += 1
        if b.probe_left or b.spec_n < self.min_samples or b.plain_n < self.min_samples:
            return  # judge between probe runs, once both rates are known
        wins = b.spec_rate >= b.plain_rate * (1 - self.tolerance if b.on else 1)
        if b.on and not wins:  # turn off, probe again after the wait
            b.on, b.next_probe = False, b.steps + b.wait
        elif not b.on and wins:
            b.on, b.wait, b.next_probe = True, self.off_wait, b.steps + self.probe_every
        elif not b.on and b.next_probe == 0:  # a speculating probe run lost again: wait longer
            b.wait = min(2 * b.wait, self.max_wait)
            b.next_probe = b.steps + b.wait
        elif b.on and b.next_probe == 0:
            b.next_probe = b.steps + self.probe_every

    def state(self) -> dict[int, dict]:
        """Each bucket's rates and mode (for /admin and benchmarks)."""
        return {
            k: {
                "speculates": b.on,
                "spec_tokens_per_row_s": round(b.spec_rate, 3),
                "plain_tokens_per_row_s": round(b.plain_rate, 3),
                "spec_steps": b.spec_n,
                "plain_steps": b.plain_n,
            }
            for k, b in sorted(self.buckets.items())
        }

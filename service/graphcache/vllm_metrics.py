"""vLLM's Prometheus series (`vllm:` prefix) beside graphcache's own, on the same registry.

vLLM's Grafana dashboards, the production-stack router and KEDA scalers query these names; with them a
graphcache server drops in where a vLLM one was. Names, types, labels and buckets follow vLLM v1's
Prometheus logger (vllm/v1/metrics/loggers.py): every series carries `model_name` (the served model
id) and `engine` ("0": graphcache runs one engine core); request_success adds `finished_reason`.

Two kinds of series:
- mirrors: gauges and counters graphcache already keeps under its own name (running, waiting, KV
  usage, token counters, preemptions, finishes by reason, prefix-cache lookups) are read from those
  instruments at scrape time, so the engine records once and the two names can never disagree;
- histograms graphcache lacks or buckets differently: recorded here, per step (iteration tokens), per
  first token (TTFT) and per finished request (phase times, lengths, per-token latency, prefill KV
  computed);
- the counters and gauges every vLLM server registers that have no graphcache twin: prompt tokens by
  source (computed / prefix cache / external, the last always 0), cached and recomputed prompt tokens,
  the engine's sleep state (always awake), and the external (KV connector) and multi-modal caches' lookups
  (0: this server has neither). vllm:request_params_n is recorded by the API (the engine sees each
  choice as its own sequence); api/server/exposition.py serves the API process's copy.

Per-token latency (inter_token_latency_seconds, and time_per_output_token_seconds, its name before
vLLM 0.11 that dashboards still query) is recorded once per request with a count: its n-1 gaps between
output tokens all at their mean. `_sum` and `_count` are exact (the decode time and the number of
gaps); only the bucket placement is averaged within a request. One histogram observation per token
would cost ~1 ms a step at batch 256 on the engine thread.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

ENGINE = "0"  # the `engine` label: vLLM numbers engine cores; graphcache has one
LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")  # vllm:lora_requests_info's
LABELS = ("model_name", "engine")

# vLLM's buckets.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# vllm:prompt_tokens_by_source's `source` values; external_kv_transfer stays 0 (no KV connector here).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vllm:engine_sleep_state's `sleep_state` values; this server never sleeps, so awake is always 1.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's ladder for token counts)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# vLLM ends this ladder at max_model_len, which is unknown when the registry is built (the model loads
# later, on the engine thread). Up to 1M covers every context length; the extra buckets stay empty.
TOKEN_COUNT_BUCKETS = one_two_five(1_000_000)


class CountedHistogram(Collector):
    """A labelled histogram whose observe() records `count` equal observations at once."""

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry
    ):
        self.name, self.documentation, self.bounds = name, documentation, tuple(float(b) for b in buckets)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], list] = {}  # label values -> [per-bucket counts (+Inf last), sum]
        registry.register(self)

    def labels(self, *values: str) -> _CountedChild:
        with self._lock:
            self._series.setdefault(values, [[0] * (len(self.bounds) + 1), 0.0])
        return _CountedChild(self, values)

    def remove(self, *values: str) -> None:
        with self._lock:
            self._series.pop(values, None)

    def observe(self, values: tuple[str, ...], value: float, count: int) -> None:
        i = bisect_left(self.bounds, value)  # first bucket whose upper bound (le) is >= value
        with self._lock:
            series = self._series[values]
            series[0][i] += count
            series[1] += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=LABELS)
        with self._lock:
            snapshot = [(values, list(counts), total) for values, (counts, total) in self._series.items()]
        for values, counts, total in snapshot:
            cumulative, buckets = 0, []
            for le, n in zip([*map(floatToGoString, self.bounds), "+Inf"], counts, strict=True):
                cumulative += n
                buckets.append((le, cumulative))
            family.add_metric(list(values), buckets, total)
        yield family


class _CountedChild:
    __slots__ = ("parent", "values")

    def __init__(self, parent: CountedHistogram, values: tuple[str, ...]) -> None:
        self.parent, self.values = parent, values

    def observe(self, value: float, count: int = 1) -> None:
        self.parent.observe(self.values, value, count)


def _samples(metric, suffix: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of a prometheus_client instrument's samples named <family><suffix>."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name == family.name + suffix:
                yield sample.labels, sample.value


class _Mirror(Collector):
    """The vLLM gauges and counters that are graphcache series under another name, read at scrape."""

    def __init__(self, view: VllmMetrics) -> None:
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        m, labels = self.view.metrics, [self.view.model_name, ENGINE]
        for name, doc, source in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                m.requests_running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m.requests_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage),
            (
                "vllm:gpu_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage. DEPRECATED: use "
                "vllm:kv_cache_usage_perc instead.",
                m.kv_usage,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            for _, value in _samples(source, ""):
                family.add_metric(labels, value)
            yield family
        for name, doc, source in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", m.generation_tokens),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", m.preemptions),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                m.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                m.prefix_cache_hits,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            for _, value in _samples(source, "_total"):
                counter.add_metric(labels, value)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        for sample_labels, value in _samples(m.requests_finished, "_total"):
            success.add_metric([*labels, sample_labels["reason"]], value)
        yield success
        config = self.view.cache_config
        if config:
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=[*config, "engine"],
            )
            info.add_metric([*config.values(), ENGINE], 1)
            yield info
        lora = self.view.lora_info
        if lora is not None:
            labels_now, stamp = lora
            family = GaugeMetricFamily(
                "vllm:lora_requests_info", "Running stats on lora requests.", labels=list(LORA_LABELS)
            )
            family.add_metric(list(labels_now), stamp)
            yield family


class VllmMetrics:
    """The `vllm:` series of one registry; `Metrics.vllm`. Recording methods run on the engine thread."""

    # The children for the current model_name, set by _bind() (one per key of _histograms and
    # _counters).
    ttft: Histogram
    itl: _CountedChild
    tpot: _CountedChild
    request_tpot: Histogram
    e2e: Histogram
    queue: Histogram
    inference: Histogram
    prefill: Histogram
    decode: Histogram
    prompt_len: Histogram
    generation_len: Histogram
    max_generation: Histogram
    max_tokens: Histogram
    iteration_tokens: Histogram
    n: Histogram
    prefill_kv_computed: Histogram
    prompt_tokens_cached: Counter
    prompt_tokens_recomputed: Counter
    external_prefix_cache_queries: Counter
    external_prefix_cache_hits: Counter
    mm_cache_queries: Counter
    mm_cache_hits: Counter

    def __init__(self, metrics: Any, registry: CollectorRegistry, model_name: str) -> None:
        # metrics: the owning graphcache.metrics.Metrics (untyped here: metrics.py imports this module)
        self.metrics = metrics
        self.model_name = model_name
        self.cache_config: dict[
            str, str
        ] = {}  # vllm:cache_config_info labels; empty until the KV cache exists
        # vllm:lora_requests_info's (labels, when they last changed); None: LoRA off
        self.lora_info: tuple[tuple[str, str, str], float] | None = None
        r = registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, list(LABELS), buckets=buckets, registry=r)

        self._histograms: dict[str, Histogram | CountedHistogram] = {
            "ttft": histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            ),
            "itl": CountedHistogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                TOKEN_LATENCY_BUCKETS,
                r,
            ),
            "tpot": CountedHistogram(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in "
                "seconds. DEPRECATED: use vllm:inter_token_latency_seconds instead.",
                TOKEN_LATENCY_BUCKETS,
                r,
            ),
            "request_tpot": histogram(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                TOKEN_LATENCY_BUCKETS,
            ),
            "e2e": histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "queue": histogram(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "inference": histogram(
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "prefill": histogram(
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "decode": histogram(
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "prompt_len": histogram(
                "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_COUNT_BUCKETS
            ),
            "generation_len": histogram(
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                TOKEN_COUNT_BUCKETS,
            ),
            "max_generation": histogram(
                "vllm:request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
                TOKEN_COUNT_BUCKETS,
            ),
            "max_tokens": histogram(
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                TOKEN_COUNT_BUCKETS,
            ),
            "iteration_tokens": histogram(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                ITERATION_TOKEN_BUCKETS,
            ),
        }
        self._histograms["n"] = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self._histograms["prefill_kv_computed"] = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            TOKEN_COUNT_BUCKETS,
        )

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(LABELS), registry=r)

        # Counters recorded here (vLLM's names; prometheus_client adds the `_total` sample suffix).
        # The external (KV connector) and multi-modal caches do not exist in this server: their
        # counters are declared, as on every vLLM server, and stay 0.
        self._counters: dict[str, Counter] = {
            "prompt_tokens_cached": counter(
                "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
            ),
            "prompt_tokens_recomputed": counter(
                "vllm:prompt_tokens_recomputed", "Number of cached tokens recomputed for forward pass."
            ),
            "external_prefix_cache_queries": counter(
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, "
                "in terms of number of queried tokens.",
            ),
            "external_prefix_cache_hits": counter(
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, "
                "in terms of number of cached tokens.",
            ),
            "mm_cache_queries": counter(
                "vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."
            ),
            "mm_cache_hits": counter(
                "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."
            ),
        }
        self._by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*LABELS, "source"],
            registry=r,
        )
        self._sleep_state = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*LABELS, "sleep_state"],
            registry=r,
        )
        r.register(_Mirror(self))
        self._bind()

    def _bind(self) -> None:
        for key, family in self._histograms.items():
            setattr(self, key, family.labels(self.model_name, ENGINE))
        for key, counter in self._counters.items():
            setattr(self, key, counter.labels(self.model_name, ENGINE))
        self.by_source = {s: self._by_source.labels(self.model_name, ENGINE, s) for s in PROMPT_SOURCES}
        for state in SLEEP_STATES:
            self._sleep_state.labels(self.model_name, ENGINE, state).set(1 if state == "awake" else 0)

    def bind_model(self, model_name: str) -> None:
        """Label every series with `model_name` from now on. Call before traffic: what was recorded
        under the old name is dropped, so no stale series lingers."""
        if model_name == self.model_name:
            return
        for family in [*self._histograms.values(), *self._counters.values()]:
            family.remove(self.model_name, ENGINE)
        for source in PROMPT_SOURCES:
            self._by_source.remove(self.model_name, ENGINE, source)
        for state in SLEEP_STATES:
            self._sleep_state.remove(self.model_name, ENGINE, state)
        self.model_name = model_name
        self._bind()

    def set_cache_config(self, **labels: Any) -> None:
        """vllm:cache_config_info's labels (block_size, num_gpu_blocks, ...)."""
        self.cache_config = {k: str(v) for k, v in labels.items()}

    def set_lora_info(self, max_lora: int, running: list[str], waiting: list[str]) -> None:
        """vllm:lora_requests_info, as vLLM: one sample whose labels are the slots and the adapters of the
        running and the waiting requests (comma-separated, sorted), valued the wall time they last changed."""
        labels = (str(max_lora), ",".join(sorted(waiting)), ",".join(sorted(running)))
        if self.lora_info is None or self.lora_info[0] != labels:
            self.lora_info = (labels, time.time())

    # --- recording (engine thread) ---------------------------------------------------------------------
    def observe_step(self, num_tokens: int) -> None:
        """One engine step computed `num_tokens` tokens (prefill chunks and decodes together)."""
        self.iteration_tokens.observe(num_tokens)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A request's prompt is prefilled: `num_cached_tokens` of it came from the prefix cache, the
        rest was computed (vLLM's split, counted once per request as its first token comes)."""
        self.prompt_tokens_cached.inc(num_cached_tokens)
        self.by_source["local_cache_hit"].inc(num_cached_tokens)
        self.by_source["local_compute"].inc(num_prompt_tokens - num_cached_tokens)

    def observe_recomputed(self, num_tokens: int) -> None:
        """`num_tokens` tokens whose KV had been computed once were computed again (re-prefill after
        preemption by recompute: the KV freed then and not found in the prefix cache on return)."""
        self.prompt_tokens_recomputed.inc(num_tokens)

    def observe_request_n(self, n: int) -> None:
        """An API request asked for `n` choices (recorded where the request is parsed: the engine sees
        each choice as its own sequence)."""
        self.n.observe(n)

    def observe_finished(self, seq, now: float) -> None:
        """A finished Sequence's phase times and lengths (vLLM's definitions: queue = arrival -> first
        scheduled, prefill = first scheduled -> first token, decode = first -> last token, inference =
        first scheduled -> last token). A phase the request never reached is not observed."""
        self.e2e.observe(now - seq.arrival_time)
        scheduled, first, last = seq.first_scheduled_time, seq.first_token_time, seq.last_token_time
        if scheduled is not None:
            self.queue.observe(scheduled - seq.arrival_time)
            if first is not None:
                self.prefill.observe(first - scheduled)
            if last is not None:
                self.inference.observe(last - scheduled)
        if first is not None and last is not None:
            self.decode.observe(last - first)
        n = seq.num_output_tokens
        self.prompt_len.observe(seq.num_prompt_tokens)
        self.prefill_kv_computed.observe(seq.num_prompt_tokens - seq.num_cached_tokens)
        self.generation_len.observe(n)
        self.max_generation.observe(n)  # one sequence per choice here: its own length is the group's max
        if seq.params.max_tokens is not None:
            self.max_tokens.observe(seq.params.max_tokens)
        if n > 1 and first is not None and last is not None:
            gap = (last - first) / (n - 1)
            self.itl.observe(gap, n - 1)
            self.tpot.observe(gap, n - 1)
            self.request_tpot.observe(gap)

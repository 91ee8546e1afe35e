"""All Prometheus instruments of graphcache, on one registry per server instance.

Lives on the lowest floor (beside config.py) so the graph cache and the engine can
record directly, from the engine thread, without importing the HTTP floor.
prometheus-client instruments are thread-safe; the API floor only exposes
`Metrics.registry`. Names: prefix `graphcache_`, base units, `_total` on counters,
bounded labels (mode, reason, backend: a handful of values each).

The same registry carries vLLM's `vllm:` series (vllm_metrics.py, `Metrics.vllm`), so dashboards
and autoscalers built for vLLM read graphcache unchanged, and the process metrics (process_*,
python_*) that prometheus_client's default registry would have.
"""

from __future__ import annotations

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from graphcache.choices import CAPTURE_MODES, STEP_MODES
from graphcache.vllm_metrics import VllmMetrics

# Buckets sized for what these measure: captures take 1 ms - 10 s, a step 0.1 ms - 10 s.
CAPTURE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
LATENCY_BUCKETS = (
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
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

EVICTION_REASONS = ("entries", "bytes", "clear", "manual")
FAILURE_REASONS = ("error", "oom", "budget")

FINISH_REASONS = ("stop", "length", "abort", "error")

# The `model_name` label of the vllm: series until bind_model() names the served model: what the
# Engine serves when no model is configured (create_app binds the engine's real name).
DEFAULT_MODEL_NAME = "graphcache-tiny"


class GraphCacheMetrics:
    """One graph cache's instruments, under a name prefix: the target's `graphcache_graph_*` (Metrics is
    one) and, beside it, the draft model's `graphcache_draft_graph_*` (speculative decoding), so the
    target's series keep their names and labels and a draft's captures, hits and pool bytes are their own.
    `what` starts each help text of the draft's series ("Draft model: ")."""

    def __init__(self, r: CollectorRegistry, p: str, what: str = "") -> None:
        self.graph_backend = Gauge(
            p + "graph_backend_info",
            what + "Capture backend in use (1 for the active one)",
            ["backend"],
            registry=r,
        )
        self.graph_entries = Gauge(
            p + "graph_cache_entries", what + "Captured graphs held in the cache", registry=r
        )
        self.graph_entries_by_mode = Gauge(
            p + "graph_cache_entries_by_mode",
            what + "Captured graphs held, by capture mode (full: one graph with attention "
            "inside; breakable: graph segments around eager attention)",
            ["mode"],
            registry=r,
        )
        self.graph_max_entries = Gauge(
            p + "graph_cache_max_entries", what + "Entry budget of the graph cache", registry=r
        )
        self.graph_pool_bytes = Gauge(
            p + "graph_pool_bytes", what + "Graph-pool bytes held, measured from the allocator", registry=r
        )
        self.graph_pool_budget_bytes = Gauge(
            p + "graph_pool_budget_bytes", what + "Graph-pool byte budget", registry=r
        )
        self.graph_hits = Counter(
            p + "graph_cache_hits", what + "Steps served by replay of a cached capture", registry=r
        )
        self.graph_misses = Counter(
            p + "graph_cache_misses", what + "Steps whose descriptor had no capture", registry=r
        )
        self.graph_captures = Counter(p + "graph_captures", what + "Successful captures", registry=r)
        self.graph_capture_seconds = Histogram(
            p + "graph_capture_seconds",
            what + "Wall time of one capture",
            buckets=CAPTURE_BUCKETS,
            registry=r,
        )
        self.graph_capture_stall_seconds = Histogram(
            p + "graph_capture_stall_seconds",
            what + "Lazy captures while serving: how long the step that missed waited",
            buckets=CAPTURE_BUCKETS,
            registry=r,
        )
        self.graph_captures_deferred = Counter(
            p + "graph_captures_deferred",
            what + "Misses served eagerly because lazy captures used their share of "
            "serving time (captured at a later miss)",
            registry=r,
        )
        self.graph_evictions = Counter(
            p + "graph_evictions", what + "Captures dropped, by reason", ["reason"], registry=r
        )
        self.graph_capture_failures = Counter(
            p + "graph_capture_failures",
            what + "Captures refused or failed (then served eagerly), by reason",
            ["reason"],
            registry=r,
        )
        self.padded_tokens = Counter(
            p + "padded_tokens", what + "Padding tokens added to reach a capture size", registry=r
        )
        for mode in CAPTURE_MODES:
            self.graph_entries_by_mode.labels(mode)
        for reason in EVICTION_REASONS:
            self.graph_evictions.labels(reason)
        for reason in FAILURE_REASONS:
            self.graph_capture_failures.labels(reason)


class Metrics(GraphCacheMetrics):
    """Every instrument, created on its own registry (tests build many servers in one process)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
        *,
        process_collectors: bool = True,
    ) -> None:
        """process_collectors=False: no process_*/python_* series (the engine process's registry: the API
        process exports its own under those names, engine/loop/process.py)."""
        self.registry = r = registry if registry is not None else CollectorRegistry()
        # engine/spec/metrics.py's SpecDecodeMetrics on this registry, once speculation is configured
        # (EngineCore registers it; object: this floor does not import the engine)
        self.spec_decode: object = None
        p = "graphcache_"
        if r is not REGISTRY and process_collectors:  # the global registry has them already
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

        # --- graph cache: the target's (GraphCacheMetrics); tensor parallelism's per-rank bytes ---
        super().__init__(r, p)
        # Tensor parallelism (N > 1 only): each rank's own measurement of the entries held (the cache budgets
        # use the max over ranks); from the agreed decision log, engine/worker/tp_runner.py.
        self.graph_pool_rank_bytes = Gauge(
            p + "graph_pool_rank_bytes",
            "Graph-pool bytes held, as each tensor-parallel rank measured its own pools",
            ["rank"],
            registry=r,
        )
        # The draft model's graph cache (speculative decoding), once one is built: draft_graph_metrics().
        self.draft_graph: GraphCacheMetrics | None = None

        # --- engine ---
        self.steps = Counter(p + "steps", "Model steps, by execution mode", ["mode"], registry=r)
        self.grammar_cache_bytes = Gauge(
            p + "grammar_cache_bytes",
            "Estimated bytes of compiled output constraints in the grammar cache (engine/structured.py)",
            registry=r,
        )
        self.requests_running = Gauge(p + "num_requests_running", "Requests in the running batch", registry=r)
        self.requests_waiting = Gauge(p + "num_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Share of KV blocks in use (0-1)", registry=r)
        self.preemptions = Counter(
            p + "num_preemptions", "Sequences preempted (recomputed later)", registry=r
        )
        # Prompt tokens looked up in the prefix cache at admission, and those found (vLLM counts tokens).
        self.prefix_cache_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.step_seconds = Histogram(
            p + "step_seconds",
            "Wall time of one model step, by mode",
            ["mode"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            p + "batch_size", "Requests in one step", buckets=BATCH_BUCKETS, registry=r
        )
        for mode in STEP_MODES:
            self.steps.labels(mode)
            self.step_seconds.labels(mode)
        self.ready = Gauge(p + "ready", "1 once the model is loaded and warmup is done", registry=r)
        self.warmup_done = Gauge(
            p + "warmup_descriptors_done", "Startup warmup: descriptors processed so far", registry=r
        )
        self.warmup_total = Gauge(
            p + "warmup_descriptors_planned", "Startup warmup: descriptors to process", registry=r
        )

        # --- requests ---
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            p + "time_per_output_token_seconds",
            "Time between output tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Request latency, arrival to finish",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.requests_finished = Counter(
            p + "requests_finished", "Finished requests, by finish reason", ["reason"], registry=r
        )
        self.requests_rejected = Counter(
            p + "requests_rejected", "Requests refused before admission, by reason", ["reason"], registry=r
        )
        for reason in FINISH_REASONS:
            self.requests_finished.labels(reason)
        for reason in ("queue_full", "invalid", "draining"):
            self.requests_rejected.labels(reason)

        # --- LoRA adapters (--enable-lora; engine/worker/lora_slots.py) ---
        self.lora_slots = Gauge(p + "lora_slots", "GPU adapter slots (--max-loras; 0: LoRA off)", registry=r)
        self.lora_slots_in_use = Gauge(
            p + "lora_slots_in_use", "GPU adapter slots holding an adapter", registry=r
        )
        self.lora_load_seconds = Histogram(
            p + "lora_load_seconds",
            "Seconds to write an adapter into a GPU slot (host side, between steps)",
            buckets=CAPTURE_BUCKETS,
            registry=r,
        )

        # --- vLLM's names, on the same registry ---
        self.vllm = VllmMetrics(self, r, model_name)

    def draft_graph_metrics(self) -> GraphCacheMetrics:
        """The draft model's graph-cache series (`graphcache_draft_graph_*`, ...), made on the first call: they
        exist only where a draft model runs, as vLLM's spec_decode series exist only where speculation is
        configured; a second draft on this registry shares them."""
        if self.draft_graph is None:
            self.draft_graph = GraphCacheMetrics(self.registry, "graphcache_draft_", "Draft model: ")
        return self.draft_graph

    def bind_model(self, model_name: str) -> None:
        """The served model id, for the `model_name` label of the vllm: series (before traffic)."""
        self.vllm.bind_model(model_name)

"""Which sizes a step pads to: the fine sizes (decode and small mixed steps) and the coarse mixed
buckets above them, chosen by the rule below unless the settings name them.

The rule for the default mixed buckets: a graph is worth padding to only while the step is host-bound.
An eager step costs its launches on the host (about EAGER_HOST_SECONDS_PER_LAYER a layer, whatever
its size); a replayed one costs its GPU work, mostly GEMMs over the padded tokens (2 x decoder weights x
tokens FLOPs at GEMM_FLOPS_PER_SECOND). A bucket of B tokens is kept while that GEMM time at B stays
under the eager launch time: then a step anywhere in the bucket, padded up to B, is no slower on the
GPU than its eager launches are on the host. Past it the step is GPU-bound, the launches hide under
the GPU work, and padding would only add FLOPs. At the Qwen2.5-0.5B shape (358M decoder weights, 24
layers) this keeps 384..6144; at Llama-3-8B (7.0B, 32 layers) 384 only. The constants are the H200's
(bf16 GEMMs at ~40% of peak, the 0.5B eager step's ~13 ms of launches); benchmarks/big_steps.py
measures both sides at each size, and a deployment that knows better sets mixed_capture_sizes.
Without a CUDA graph backend there is nothing to save, so no buckets.

FP8 weights with per-row scales (W8A8: x quantized per row, then cuBLASLt's row-scaled GEMM) take every
bucket. Their GEMMs run at about 1.5x bf16's rate and each linear layer launches two kernels instead of
one, so their eager mixed steps stay host-bound at every size up to 2,048 tokens at 8B. Measured on two
H100 hosts, realistic workload: graphs up to 2,048 took the mixed steps from 41.2 to 39.9 ms and from 48.4
to 40.2 ms (+2.4% and +20% throughput). The same graphs made bf16 8B 1-3% slower on both hosts (BENCHMARKS
§29, §30).
"""

from __future__ import annotations

from graphcache.config import Settings
from graphcache.graphs.descriptor import CaptureSizes, mixed_buckets

__all__ = [
    "EAGER_HOST_SECONDS_PER_LAYER",
    "GEMM_FLOPS_PER_SECOND",
    "host_bound_buckets",
    "resolve_capture_sizes",
]

EAGER_HOST_SECONDS_PER_LAYER = 0.5e-3  # an eager step's host launches per decoder layer (0.5B: ~13 ms / 24)
GEMM_FLOPS_PER_SECOND = 400e12  # bf16 GEMMs of a few thousand rows on the H200


def host_bound_buckets(buckets: list[int], *, decoder_params: int, num_layers: int) -> list[int]:
    """The buckets whose padded GEMM time stays under an eager step's launch time (the rule above)."""
    launch_seconds = num_layers * EAGER_HOST_SECONDS_PER_LAYER
    return [b for b in buckets if 2 * decoder_params * b / GEMM_FLOPS_PER_SECOND <= launch_seconds]


def resolve_capture_sizes(
    settings: Settings,
    *,
    graphs: bool,
    decoder_params: int,
    num_layers: int,
    quantized_activations: bool = False,
) -> tuple[CaptureSizes, CaptureSizes]:
    """(sizes, mixed_sizes): what decode steps pad to, and what mixed steps pad to (sizes plus the
    buckets above them, never past max_num_batched_tokens: no step is bigger). graphs: the runner
    captures real CUDA graphs (the default buckets apply only then); decoder_params: this rank's
    weights in the decoder layers (the GEMMs every token runs through); quantized_activations: the
    linear layers quantize x per row before their GEMMs (FP8 per-row weights: every bucket, see above)."""
    sizes = CaptureSizes(settings.graph_cache.resolved_capture_sizes())
    limit = settings.engine.max_num_batched_tokens
    if settings.graph_cache.mixed_capture_sizes is not None:
        buckets = [b for b in settings.graph_cache.mixed_capture_sizes if sizes.max < b <= limit]
    elif graphs and quantized_activations:
        buckets = mixed_buckets(sizes.max, limit)
    elif graphs:
        buckets = host_bound_buckets(
            mixed_buckets(sizes.max, limit), decoder_params=decoder_params, num_layers=num_layers
        )
    else:
        buckets = []
    return sizes, CaptureSizes([*sizes, *buckets])

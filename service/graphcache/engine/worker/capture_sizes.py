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
    settings: Settings, *, graphs: bool, decoder_params: int, num_layers: int
) -> tuple[CaptureSizes, CaptureSizes]:
    """(sizes, mixed_sizes): what decode steps pad to, and what mixed steps pad to (sizes plus the
    buckets above them, never past max_num_batched_tokens: no step is bigger). graphs: the runner
    captures real CUDA graphs (the default buckets apply only then); decoder_params: this rank's
    weights in the decoder layers (the GEMMs every token runs through)."""
    sizes = CaptureSizes(settings.graph_cache.resolved_capture_sizes())
    limit = settings.engine.max_num_batched_tokens
    if settings.graph_cache.mixed_capture_sizes is not None:
        buckets = [b for b in settings.graph_cache.mixed_capture_sizes if sizes.max < b <= limit]
    elif graphs:
        buckets = host_bound_buckets(
            mixed_buckets(sizes.max, limit), decoder_params=decoder_params, num_layers=num_layers
        )
    else:
        buckets = []
    return sizes, CaptureSizes([*sizes, *buckets])

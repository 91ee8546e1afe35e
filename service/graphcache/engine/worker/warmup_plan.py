"""The descriptors a runner captures at start: from the settings' sizes, or exactly a saved profile's.

Without a profile: the decode capture sizes up to max_num_seqs (or warmup_decode_sizes), the mixed
buckets above the largest decode size (or warmup_mixed_sizes), with --speculative-config the verify
descriptors ("T:T:verify", T a capture size from 2 up to max_num_seqs' padded size and the most tokens a
verify step feeds; only when warmup_decode_sizes is left to its default), then any explicit
warmup_descriptors. With --enable-lora each of those also in its LoRA variant (graphs/descriptor.py: steps
with an adapter token replay it, steps without the plain one): the decode ones first, then the mixed and
verify ones, while the set stays within cache_max_entries (past it a warmup would evict its own captures;
the variants of one shape share the pinned pool, so they add entries, not much memory).
With GRAPHCACHE_WARMUP_PROFILE (GET /admin/cache/profile's output) the file's set alone, each entry
checked to be a shape a step pads to, so a stale profile fails the start instead of growing the
static buffers. The runner (runner.py) sizes its buffers to cover whichever set this returns.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from graphcache.config import Settings
from graphcache.engine.spec.config import parse_speculative_config
from graphcache.graphs.descriptor import BatchDescriptor, CaptureSizes
from graphcache.graphs.policy.profile import parse_profile

__all__ = ["load_warmup_profile", "warmup_descriptors"]

log = logging.getLogger(__name__)


def warmup_descriptors(
    settings: Settings, sizes: CaptureSizes, mixed_sizes: CaptureSizes, *, graphs: bool = False
) -> list[BatchDescriptor]:
    """The configured warmup set. sizes: what decode steps pad to; mixed_sizes: what mixed steps pad to;
    graphs: CUDA graphs are captured (the runner's cuda backend)."""
    s = settings
    if s.graph_cache.warmup_profile is not None:  # exactly the profile's set
        return load_warmup_profile(
            s.graph_cache.warmup_profile, sizes, mixed_sizes, s.engine.max_num_seqs, lora=s.lora.enable_lora
        )
    decode = s.graph_cache.warmup_decode_sizes
    default_decode = decode is None
    if decode is None:
        decode = [n for n in sizes if n <= s.engine.max_num_seqs]
    descs = [BatchDescriptor(n, n, True) for n in decode]
    mixed = s.graph_cache.warmup_mixed_sizes
    buckets = [n for n in mixed_sizes if n > sizes.max]
    if mixed is None:
        # With no bucket above the decode sizes (a large model keeps none at max_capture_size 512:
        # capture_sizes.py), still one mixed graph, the largest fine size: its capture compiles the mixed
        # step's kernels (the unified attention's chunk tiles) before /ready. Else the first prefill while
        # serving compiles them, up to seconds on a cold Triton cache during which every request waits.
        mixed = buckets or ([sizes.max] if graphs and len(sizes) else [])
    elif any(n not in buckets for n in mixed):
        raise ValueError(
            f"warmup_mixed_sizes {mixed} must be mixed buckets in use {buckets} (mixed_capture_sizes "
            "above max_capture_size, up to max_num_batched_tokens)"
        )
    pad_reqs = sizes.pad(s.engine.max_num_seqs) or s.engine.max_num_seqs  # descriptor_for's R cap (max_reqs)
    descs += [BatchDescriptor(n, min(n, pad_reqs), False) for n in mixed]
    spec = parse_speculative_config(s.engine.speculative_config)
    if spec is not None and default_decode:
        # A verify step replays "T:T:verify" while its T fed tokens fit the logits rows (runner.py)
        most = min(
            pad_reqs, mixed_sizes.pad(s.engine.max_num_seqs * (spec.num_speculative_tokens + 1)) or pad_reqs
        )
        descs += [BatchDescriptor(n, n, False, True) for n in mixed_sizes if 2 <= n <= most]
    if s.lora.enable_lora:
        descs = with_lora_variants(descs, s.graph_cache.max_entries)
    explicit = [BatchDescriptor.parse(d) for d in s.graph_cache.warmup_descriptors]
    if not s.lora.enable_lora and any(d.lora for d in explicit):
        raise ValueError(
            "warmup_descriptors names LoRA variants (':lora'), but LoRA is off; drop ':lora' or set --enable-lora"
        )
    return descs + explicit


def with_lora_variants(descs: list[BatchDescriptor], max_entries: int) -> list[BatchDescriptor]:
    """descs (plain) and their LoRA variants: every decode one's, then the mixed and verify ones', as long as
    the whole set stays within max_entries (the cache's entry budget)."""
    plain = [d.with_lora(False) for d in descs]
    variants = [d.with_lora() for d in plain if d.uniform_decode] + [
        d.with_lora() for d in plain if not d.uniform_decode
    ]
    room = max(max_entries - len(plain), 0)
    if len(variants) > room:
        log.info(
            "warmup: %d of %d LoRA graph variants fit cache_max_entries %d; the rest are captured when "
            "steps with adapters first need them",
            room,
            len(variants),
            max_entries,
        )
    return plain + variants[:room]


def load_warmup_profile(
    path: Path, sizes: CaptureSizes, mixed_sizes: CaptureSizes, max_num_seqs: int, *, lora: bool = False
) -> list[BatchDescriptor]:
    """The descriptors of a GRAPHCACHE_WARMUP_PROFILE file (GET /admin/cache/profile's output). Each
    must be a shape a step pads to (tokens and requests capture sizes, requests within max_num_seqs'
    padded size), so none grows the static buffers, and a LoRA variant only where LoRA is on (lora);
    anything else fails the start, naming the file and the entry."""
    where = f"warmup_profile {str(path)!r} (GRAPHCACHE_WARMUP_PROFILE)"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where} cannot be read as JSON: {type(e).__name__}: {e}") from None
    try:
        descs = parse_profile(data)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    max_reqs = sizes.pad(max_num_seqs) or sizes.max
    for i, d in enumerate(descs):
        tokens = sizes if d.uniform_decode else mixed_sizes
        if d.num_tokens not in tokens.sizes or d.num_reqs not in sizes.sizes or d.num_reqs > max_reqs:
            raise ValueError(
                f"{where}: descriptors[{i}] {d} has sizes this server never pads to; tokens must "
                f"be one of the capture sizes {list(tokens)}, requests one of {list(sizes)} "
                f"(up to {max_reqs}); export the profile again from a server with these settings"
            )
        if d.lora and not lora:
            raise ValueError(
                f"{where}: descriptors[{i}] {d} is a LoRA variant, but LoRA is off; set --enable-lora or "
                "export the profile again from a server without it"
            )
    log.info("warmup profile %s: %d descriptors", path, len(descs))
    return descs

"""Warmup profiles: the hot set of descriptors learned from traffic, as JSON, and back.

`GraphCache.profile()` exports it (GET /admin/cache/profile); `parse_profile` reads it back for
GRAPHCACHE_WARMUP_PROFILE and POST /admin/warmup {"profile": ...}. Shape:
    {"version": 1, "descriptors": [{"descriptor": "T:R[:decode|:verify][:lora]", "mode": "full" | "breakable" | null,
                                    "uses": n, "bytes": b, "capture_ms": x}, ...]}   most used first
and, after them, the gaps `fill_size_gaps` adds ({..., "uses": 0, "filled": true}).

Why fill gaps: which padded token sizes a run meets depends on timing (how requests happen to share
steps), so a second run of the same traffic meets sizes the first one did not (on the H200 load test,
2 of ~26). Within the span of sizes traffic used, every capture size is one
descriptor of the same kind; warming the gaps costs one capture each (~20 ms, a few MiB in the shared
pinned pool) and spares a lazy capture on the serving path.
"""

from __future__ import annotations

from typing import Any

from graphcache.graphs.descriptor import BatchDescriptor, CaptureSizes

__all__ = ["PROFILE_MAX_DESCRIPTORS", "PROFILE_VERSION", "build_profile", "fill_size_gaps", "parse_profile"]

PROFILE_VERSION = 1
PROFILE_MAX_DESCRIPTORS = 4096  # a profile larger than this is not a hot set (and not read)


def build_profile(
    uses: dict[BatchDescriptor, int],
    captured: dict[BatchDescriptor, tuple[str | None, int, float]],
    min_uses: int = 1,
) -> dict:
    """Every descriptor with at least `min_uses` uses (min_uses <= 0 adds those only captured), most used
    first; `captured` holds each one's last capture as (mode, bytes, seconds)."""
    known = set(uses) | (set(captured) if min_uses <= 0 else set())
    hot = [d for d in known if uses.get(d, 0) >= min_uses]
    hot.sort(key=lambda d: (-uses.get(d, 0), -d.num_tokens, -d.num_reqs, not d.uniform_decode, not d.lora))
    out = []
    for d in hot:
        mode, size, seconds = captured.get(d, (None, 0, 0.0))
        out.append(
            {
                "descriptor": str(d),
                "mode": mode,
                "uses": uses.get(d, 0),
                "bytes": size,
                "capture_ms": round(seconds * 1e3, 3),
            }
        )
    return {"version": PROFILE_VERSION, "descriptors": out}


def fill_size_gaps(profile: dict, sizes: CaptureSizes) -> dict:
    """`profile` (build_profile's shape) plus, for each kind (decode or mixed, plain or LoRA variant)
    separately, every capture size between the smallest and the largest token size that traffic used
    (uses > 0) and no descriptor of that kind holds yet, appended as {"uses": 0, "filled": true}. A mixed
    descriptor's requests follow descriptor_for's rule, R = min(T, cap), with cap read off the profile
    itself (the R of any used mixed descriptor with R < T); decode descriptors have R = T."""
    items = list(profile["descriptors"])
    parsed = [(BatchDescriptor.parse(p["descriptor"]), p["uses"]) for p in items]
    held = {d for d, _ in parsed}
    for decode, lora in ((True, False), (False, False), (True, True), (False, True)):
        # Only used descriptors say what steps pad to (warmup may hold any shape, e.g. "64:8").
        # (verify descriptors are filled by nobody: their token sizes follow the drafts, not the ladder)
        used = [
            d
            for d, uses in parsed
            if uses > 0 and d.uniform_decode is decode and d.lora is lora and not d.verify
        ]
        if not used:
            continue
        lo, hi = min(d.num_tokens for d in used), max(d.num_tokens for d in used)
        cap = min((d.num_reqs for d in used if d.num_reqs < d.num_tokens), default=None)
        for t in sizes:
            desc = BatchDescriptor(t, t if decode or cap is None else min(t, cap), decode, False, lora)
            if lo < t < hi and desc not in held:
                items.append(
                    {
                        "descriptor": str(desc),
                        "mode": None,
                        "uses": 0,
                        "bytes": 0,
                        "capture_ms": 0.0,
                        "filled": True,
                    }
                )
    return {**profile, "descriptors": items[:PROFILE_MAX_DESCRIPTORS]}


def parse_profile(data: Any) -> list[BatchDescriptor]:
    """The descriptors of a profile in `GraphCache.profile()`'s shape, in its order.

    {"version": 1, "descriptors": [{"descriptor": "T:R[:decode|:verify][:lora]", ...}, ...]}; the other fields of an
    item (mode, uses, bytes, capture_ms) are information only. ValueError names the first bad part
    ("descriptors[3].descriptor") without echoing long input. Whether the server can capture the
    shapes (capture sizes, static buffers) is the caller's check."""
    if not isinstance(data, dict):
        raise ValueError(
            'a profile is a JSON object {"version": 1, "descriptors": [...]} (GET /admin/cache/profile)'
        )
    if data.get("version") != PROFILE_VERSION:
        raise ValueError(f'profile "version" must be {PROFILE_VERSION}')
    items = data.get("descriptors")
    if not isinstance(items, list):
        raise ValueError(
            'profile "descriptors" must be a list of {"descriptor": "TOKENS:REQS[:decode]", ...}'
        )
    if len(items) > PROFILE_MAX_DESCRIPTORS:
        raise ValueError(f"profile has {len(items)} descriptors, more than {PROFILE_MAX_DESCRIPTORS}")
    out: list[BatchDescriptor] = []
    for i, item in enumerate(items):
        text = item.get("descriptor") if isinstance(item, dict) else None
        if not isinstance(text, str):
            raise ValueError(f'descriptors[{i}] must be an object with a "descriptor" string')
        try:
            out.append(BatchDescriptor.parse(text[:64]))
        except ValueError:
            raise ValueError(
                f'descriptors[{i}].descriptor is not a batch descriptor; write "TOKENS:REQS" or '
                '"TOKENS:REQS:decode" (":verify", and ":lora" last for the LoRA variant), e.g. "64:8" or '
                '"8:8:decode"'
            ) from None
    return out

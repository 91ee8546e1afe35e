"""Admin endpoints over the graph cache: inspect, export the traffic profile, warm up, clear; reset the prefix cache.

All are commands on the engine's inbox, run on the engine thread between steps, so
requests in flight keep going. Auth (the README states the choice):
  * admin_token set: `Authorization: Bearer <token>` required; 401 without it, 403 when
    wrong; the header's bytes as received compared with hmac.compare_digest (constant time).
    The token must be ASCII (settings/http.py refuses others at start): header values are Latin-1
    on the wire, while clients such as curl send what the shell gives them (UTF-8).
  * no token: admin is off (403 naming GRAPHCACHE_ADMIN_TOKEN), unless
    admin_allow_loopback lets clients on 127.0.0.1/::1 in. Behind a proxy on the same host
    every client looks local: set a token there instead.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import APIRouter, Depends, Query, Request

from graphcache.api.openai.utility_requests import WarmupRequest
from graphcache.api.server.auth import bearer_token
from graphcache.api.server.errors import APIError, api_error_for
from graphcache.graphs.descriptor import BatchDescriptor, CaptureSizes
from graphcache.graphs.policy.profile import fill_size_gaps, parse_profile

__all__ = ["router"]


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_admin(request: Request) -> None:
    settings = request.app.state.settings
    token = settings.http.admin_token
    if not token:
        if settings.http.admin_allow_loopback and _is_loopback(
            request.client.host if request.client else None
        ):
            return
        raise APIError(
            403,
            "Admin endpoints are off: set GRAPHCACHE_ADMIN_TOKEN (--admin-token) and send "
            "'Authorization: Bearer <token>', or set GRAPHCACHE_ADMIN_ALLOW_LOOPBACK=true for "
            "local clients.",
            code="admin_disabled",
        )
    given = bearer_token(request)
    if given is None:
        raise APIError(
            401,
            "Admin endpoints need 'Authorization: Bearer <token>' (GRAPHCACHE_ADMIN_TOKEN).",
            code="missing_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(given, token.encode("utf-8")):
        raise APIError(403, "The admin token is wrong.", code="invalid_token")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])


def _ready_engine(request: Request):
    engine = request.app.state.engine
    refused = engine.refusal(admin=True)
    if refused is None:
        return engine
    if not engine.alive:  # authenticated: the cause may be shown
        raise APIError(
            503,
            f"The engine is dead: {engine.error or 'unknown error'}; restart the server.",
            code="engine_dead",
        )
    raise api_error_for(refused)


def _descriptors(body: WarmupRequest, settings) -> list[BatchDescriptor]:
    """Only shapes the runner can pad a batch to: anything else would never be replayed
    (and a huge one could exhaust memory on the engine thread)."""
    sizes = CaptureSizes(settings.graph_cache.resolved_capture_sizes())
    max_reqs = sizes.pad(settings.engine.max_num_seqs) or sizes.max
    allowed = f"capture sizes {list(sizes)} (requests up to {max_reqs})"
    # Messages name the item by its index, never by its value: what the caller sent is not echoed.
    out: list[BatchDescriptor] = []

    lora = settings.lora.enable_lora

    def padded(d: BatchDescriptor, param: str, named: str) -> BatchDescriptor:
        if d.num_tokens not in sizes.sizes or d.num_reqs not in sizes.sizes or d.num_reqs > max_reqs:
            raise APIError(
                400,
                f"{named} has sizes the server never pads to; tokens and requests must each be one of "
                f"the {allowed}.",
                param=param,
            )
        if d.lora and not lora:
            raise APIError(
                400, f"{named} is a LoRA variant (':lora'), but this server serves no adapters.", param=param
            )
        return d

    if body.profile is not None:
        try:
            descs = parse_profile(body.profile)
        except ValueError as e:  # names the part (descriptors[i]...), never echoes the value
            raise APIError(400, f"profile: {e}.", param="profile") from None
        return sorted(
            {
                padded(d, f"profile.descriptors[{i}]", f"profile descriptors[{i}]")
                for i, d in enumerate(descs)
            },
            reverse=True,
        )
    for i, s in enumerate(body.sizes):
        if s not in sizes.sizes or s > max_reqs:
            raise APIError(
                400,
                f"sizes[{i}] is not a decode batch size the server pads to; use {allowed}.",
                param=f"sizes[{i}]",
            )
        out.append(BatchDescriptor(s, s, True))
        if lora:  # steps with an adapter replay the LoRA variant, the others the plain one
            out.append(BatchDescriptor(s, s, True, lora=True))
    for i, text in enumerate(body.descriptors):
        try:
            d = BatchDescriptor.parse(text[:64])
        except ValueError:  # its message quotes the text
            raise APIError(
                400,
                f'descriptors[{i}] is not a batch descriptor; write "TOKENS:REQS" or '
                f'"TOKENS:REQS:decode" (":lora" last for the LoRA variant), e.g. "64:8" or "8:8:decode".',
                param=f"descriptors[{i}]",
            ) from None
        out.append(padded(d, f"descriptors[{i}]", f"descriptors[{i}]"))
    return sorted(set(out), reverse=True)


@router.get("/cache")
async def cache(request: Request) -> dict:
    """Entries (descriptor, bytes, capture seconds, hits, last use, pinned), totals and budgets."""
    return await _ready_engine(request).cache_info()


@router.get("/cache/profile")
async def cache_profile(request: Request, min_uses: int = Query(1, ge=0), fill_gaps: bool = True) -> dict:
    """The hot set learned from traffic: {"version": 1, "descriptors": [{descriptor, mode, uses, bytes,
    capture_ms}]}, most used first; save it and start with GRAPHCACHE_WARMUP_PROFILE=<file>, or POST it
    to /admin/warmup as {"profile": ...}. fill_gaps (default on) appends the capture sizes inside the
    span traffic used that it happened not to meet (graphs/policy/profile.py: fill_size_gaps)."""
    engine = _ready_engine(request)
    # On the engine thread, through the engine's admin-call plumbing (as /admin/cache).
    profile = await engine.cache_profile(min_uses)
    if fill_gaps:
        profile = fill_size_gaps(
            profile, CaptureSizes(request.app.state.settings.graph_cache.resolved_capture_sizes())
        )
    return profile


@router.post("/warmup")
async def warmup(request: Request, body: WarmupRequest | None = None) -> dict:
    """Capture the given shapes (sizes/descriptors, or a profile) now; no body or {}: the configured
    warmup again (e.g. after a clear). Returns what was captured, time, bytes and failures."""
    if body is None or body.configured:
        return await _ready_engine(request).warmup(None)
    descs = _descriptors(body, request.app.state.settings)
    return await _ready_engine(request).warmup(descs)


@router.post("/clear")
async def clear(request: Request) -> dict:
    """Drop every captured graph (pinned ones too) and give their pool memory back."""
    return await _ready_engine(request).clear_graphs()


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    """Forget every cached prefix no running request holds (vLLM's /reset_prefix_cache). A KV-aware router
    hears it from the KV cache events: AllBlocksCleared, or the blocks removed while requests hold some."""
    return await _ready_engine(request).reset_prefix_cache()

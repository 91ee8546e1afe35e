"""EngineAdmin: the Engine's admin calls (warmup, graph cache, prefix cache, LoRA adapters).

Each call is a command in the engine thread's inbox, answered through an asyncio future: it runs
between two steps, so admin work never races a replay. An admin warmup's captures run in slices
between steps (EngineThread._warmup_slice); the other calls run at once. Errors go back to the caller
and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from graphcache.engine.loop.engine_thread import EngineThread
from graphcache.engine.loop.lora_admin import load_adapter, unload_adapter
from graphcache.engine.loop.messages import Call, WarmupJob, jsonable
from graphcache.engine.lora_modules import LoraModule
from graphcache.graphs.descriptor import BatchDescriptor


class EngineAdmin(EngineThread):
    """The admin calls of the in-process Engine (a base of Engine: engine.py)."""

    async def _call(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:  # the exiting engine thread fails what is queued under this lock: none is lost
            refused = self.refusal(admin=True)
            if refused is not None:
                raise refused
            self._inbox.put(Call(fn, fut, loop))
        return await fut

    async def warmup(self, descriptors: list[BatchDescriptor] | None = None) -> dict:
        """Capture (and pin) these descriptors; None: the configured warmup again (settings' decode sizes
        and descriptors, or GRAPHCACHE_WARMUP_PROFILE), e.g. after a clear. The captures interleave with
        serving: at most WARMUP_SLICE_S of them between two steps while requests run (stats()["warmup"]
        shows the progress); the answer comes when all are done."""
        if descriptors is not None:
            descriptors = [
                d if isinstance(d, BatchDescriptor) else BatchDescriptor.parse(str(d)) for d in descriptors
            ]
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            refused = self.refusal(admin=True)
            if refused is not None:
                raise refused
            self._inbox.put(WarmupJob(descriptors, fut, loop))
        return await fut

    async def clear_graphs(self) -> dict:
        return await self._call(lambda: self._admin_result(self._clear_graphs()))

    def _clear_graphs(self) -> Any:
        """Clear the target's graph cache, and the draft model's (its report under "draft")."""
        report = self._loaded_core.runner.cache.clear()
        if self._draft is None:
            return report
        return {**jsonable(report), "draft": jsonable(self._draft.runner.cache.clear())}

    async def reset_prefix_cache(self) -> dict:
        """Forget the cached prefixes nobody holds; the KV cache events say so at once."""
        return await self._call(self._reset_prefix_cache)

    def _reset_prefix_cache(self) -> dict:
        core = self._loaded_core
        dropped = core.block_manager.reset_prefix_cache()
        core.flush_kv_events()
        return {"dropped_blocks": dropped}

    async def load_lora_adapter(self, name: str, path: str) -> tuple[int, str]:
        """Read, check and lay out a LoRA adapter off the engine thread (a worker thread of the event loop:
        the batch never waits on the disk, the checks or the pinning), then register it on the engine
        thread between steps (engine/loop/lora_admin.py)."""
        module = LoraModule(name, path)
        core = self._loaded_core
        lora = core.runner.lora
        image = None
        if lora is not None:
            try:
                image = await asyncio.to_thread(lora.read_checked, module)
            except ValueError as e:  # LoraLoadError: the checkpoint, one line naming the fix
                return 400, str(e)
        return await self._call(lambda: load_adapter(lora, core.scheduler, module, image))

    async def unload_lora_adapter(self, name: str) -> tuple[int, str]:
        core = self._loaded_core
        return await self._call(lambda: unload_adapter(core.runner.lora, core.scheduler, name))

    async def cache_profile(self, min_uses: int = 1) -> dict:
        """The hot set of descriptors (GraphCache.profile): what a restart can warm up."""
        return await self._call(lambda: jsonable(self._loaded_core.runner.cache.profile(min_uses)))

    async def cache_info(self) -> dict:
        return await self._call(lambda: jsonable(self._cache_info()))

    def _cache_info(self) -> dict:
        """The target's graph cache, and the draft model's under "draft" (speculative decoding)."""
        info = self._loaded_core.runner.cache.info()
        if self._draft is not None:
            info["draft"] = self._draft.info()
        return info

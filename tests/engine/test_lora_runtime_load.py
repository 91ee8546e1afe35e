"""A runtime LoRA load through the Engine (what POST /v1/load_lora_adapter calls): the adapter is read,
checked and laid out as its slots off the engine thread, the engine thread's command only registers it, a
bad adapter is refused with the checkpoint's one line, and the loaded adapter generates exactly what the same
adapter loaded at start does. On CUDA, the slot write from the pinned image is asynchronous (no host wait on
the stream) and the slot holds what the piecewise layout gives."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from graphcache.engine.loop.engine import Engine, SamplingParams
from graphcache.engine.lora_modules import LoraModule
from graphcache.engine.worker import lora_slots
from graphcache.metrics import Metrics
from helpers_lora import peft_adapter
from helpers_model import cpu_settings, prompt_ids, tiny_checkpoint

pytest.importorskip("peft")

ENGINE_THREAD = "graphcache-engine"


@pytest.fixture(scope="module")
def base():
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def adapter(base):
    return peft_adapter(base, r=8, alpha=16, seed=41, magnitude=0.2)[0]


def _engine(settings) -> Engine:
    engine = Engine(settings, Metrics())
    engine.start()
    assert engine.wait_ready(600), engine.error
    return engine


async def _greedy(engine: Engine, rid: str, ids: list[int], lora: str | None) -> list[int]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_name=lora)
    out: list[int] = []
    async for o in engine.generate(rid, ids, params):
        out += o.token_ids
    return out


async def test_runtime_load_reads_off_the_engine_thread_and_generates_as_at_start(base, adapter, monkeypatch):
    readers: list[str] = []
    registered: list[str] = []
    real_read = lora_slots.read_lora

    def recorded_read(*args, **kwargs):
        readers.append(threading.current_thread().name)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(lora_slots, "read_lora", recorded_read)
    engine = _engine(cpu_settings(base, enable_lora=True, lora_modules=[f"first={adapter}"], max_loras=2))
    try:
        lora = engine.core.runner.lora
        real_add = lora.add

        def recorded_add(module, image):
            registered.append(threading.current_thread().name)
            return real_add(module, image)

        monkeypatch.setattr(lora, "add", recorded_add)
        readers.clear()  # the start's read (--lora-modules) runs where the engine loads
        status, message = await engine.load_lora_adapter("again", str(adapter))
        assert (status, message) == (200, "Success: LoRA adapter 'again' added successfully.")
        assert readers and ENGINE_THREAD not in readers, readers  # read on a worker thread
        assert registered == [ENGINE_THREAD]  # registered between steps
        engine.lora_modules.add(LoraModule("again", str(adapter)))

        status, message = await engine.load_lora_adapter("bad", str(base / "no-such-adapter"))
        assert status == 400 and "is not a directory" in message
        assert ENGINE_THREAD not in readers and registered == [ENGINE_THREAD]  # refused before the engine
        assert "bad" not in lora.modules

        ids = prompt_ids(11, seed=5)
        got = {name: await _greedy(engine, f"r-{name}", ids, name) for name in ("first", "again", None)}
        assert got["again"] == got["first"] != got[None]
        assert ENGINE_THREAD not in readers  # the slot write used what was read at the load
    finally:
        engine.shutdown()


@pytest.mark.cuda
def test_cuda_slot_write_from_pinned_image_is_asynchronous_and_exact(base, adapter):
    """The image is pinned; writing it into a slot while the stream is busy returns before the stream
    drains (a copy from pageable memory would wait for it); the slot then holds the pieces as laid out
    by hand in bf16, zeros elsewhere."""
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cuda_settings

    runner = ModelRunner(cuda_settings(base, enable_lora=True, lora_modules=[f"a={adapter}"], max_loras=2))
    lora = runner.lora
    assert lora is not None
    image = lora.read(lora.modules.get("a"))
    assert image.pinned and all(b.dtype == torch.bfloat16 for b in image.buffers)
    weights = lora_slots.read_lora("a", adapter, lora.config, lora.max_rank)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued on the stream
    t0 = time.perf_counter()
    lora.write(1, image)
    host_s = time.perf_counter() - t0
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy and host_s < 0.2, f"the slot write took {host_s:.3f}s of host time on a busy stream"
    for key, stack in lora.stacks.items():
        (pr, fan_in), (out, _) = stack.slot_shapes()
        want_a = torch.zeros(pr, fan_in, dtype=torch.bfloat16)
        want_b = torch.zeros(out, pr, dtype=torch.bfloat16)
        for p in weights.pieces.get(key, []):
            r, first, rows = p.a.shape[0], *stack.out_slices[p.piece]
            want_a[p.piece * stack.rank : p.piece * stack.rank + r] = p.a.bfloat16()
            want_b[first : first + rows, p.piece * stack.rank : p.piece * stack.rank + r] = p.b.bfloat16()
        assert torch.equal(stack.a[1].cpu(), want_a) and torch.equal(stack.b[1].cpu(), want_b), key


@pytest.mark.cuda
async def test_cuda_runtime_loaded_adapter_replays_as_one_loaded_at_start(base, adapter):
    """Graphs on, bf16: the adapter loaded at runtime (pinned image, asynchronous slot write) generates the
    same greedy tokens as the same adapter from --lora-modules, and not the base model's."""
    from helpers_model import cuda_settings

    engine = _engine(cuda_settings(base, enable_lora=True, lora_modules=[f"first={adapter}"], max_loras=2))
    try:
        assert await engine.load_lora_adapter("again", str(adapter)) == (
            200,
            "Success: LoRA adapter 'again' added successfully.",
        )
        engine.lora_modules.add(LoraModule("again", str(adapter)))
        ids = prompt_ids(11, seed=5)
        got = {name: await _greedy(engine, f"r-{name}", ids, name) for name in ("first", "again", None)}
        assert got["again"] == got["first"] != got[None]
    finally:
        engine.shutdown()


def test_host_memory_drops_the_adapter_least_recently_used_by_a_step(base, adapter, monkeypatch):
    """--max-cpu-loras 2 with a and b in slots, a used by every later step: a runtime load drops b from host
    memory, not a (the longest in its slot), so a needs no read from disk on the engine thread later."""
    from graphcache.engine.plan import StepPlan, StepSeq
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import Blocks

    other = peft_adapter(base, r=4, alpha=8, targets=("q_proj", "v_proj"), seed=42)[0]
    runner = ModelRunner(
        cpu_settings(base, enable_lora=True, lora_modules=[f"a={adapter}", f"b={other}"], max_loras=2)
    )
    lora = runner.lora
    assert lora is not None and lora.max_cpu_loras == 2
    ids = prompt_ids(5, seed=7)
    for name in ("a", "b", "a", "a"):
        blocks = Blocks(runner.block_size)
        runner.execute(StepPlan.standalone([StepSeq(ids, 0, blocks.table(len(ids)), lora_name=name)]))
    reads: list[str] = []
    real_read = lora_slots.read_lora
    monkeypatch.setattr(lora_slots, "read_lora", lambda name, *a: reads.append(name) or real_read(name, *a))
    module = LoraModule("c", str(other))
    lora.add(module, lora.read_checked(module))
    assert list(lora.cpu) == ["a", "c"] and reads == ["c"]

"""The capture contract on the eager backend (the same checks fire under CUDA)."""

import pytest
import torch
from graphcache.graphs.capture import CaptureError, capture, eager_break, is_capturing


@eager_break
def double_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)


@eager_break
def returns_tensor(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@eager_break
def returns_nested(x: torch.Tensor) -> dict:
    return {"y": [x + 1]}


def make_step():
    x, mid, out = torch.randn(4), torch.empty(4), torch.empty(4)

    def step():
        double_into(x + 1, mid)  # break 1
        double_into(mid, out)  # break 2
        out.add_(1)

    return x, out, step


def test_outside_capture_calls_through():
    out = torch.empty(2)
    double_into(torch.ones(2), out)
    assert out.tolist() == [2.0, 2.0]
    assert returns_tensor(torch.ones(1)).item() == 2.0  # returning is fine outside a capture
    assert not is_capturing()


def test_breaks_recorded_and_replay_reads_current_buffers():
    x, out, step = make_step()
    g = capture(step, backend="eager")
    assert g.backend == "eager" and g.num_breaks == 2 and g.num_graphs == 0
    assert g.break_names == ["double_into", "double_into"]
    for _ in range(2):
        x.copy_(torch.randn(4))
        out.fill_(float("nan"))
        g.replay()
        torch.testing.assert_close(out, (x + 1) * 4 + 1)


@pytest.mark.parametrize("op", [returns_tensor, returns_nested])
def test_tensor_return_raises_naming_fix(op):
    with pytest.raises(CaptureError, match="caller-provided output buffer"):
        capture(lambda: op(torch.ones(2)), backend="eager")
    assert not is_capturing()


def test_nested_capture_raises():
    inner_error = []

    def step():
        try:
            capture(lambda: None, backend="eager")
        except CaptureError as e:
            inner_error.append(e)
            raise

    with pytest.raises(CaptureError, match="nested"):
        capture(step, backend="eager")
    assert inner_error and not is_capturing()


def test_exception_leaves_no_capture_state_and_next_capture_works():
    def boom():
        double_into(torch.ones(1), torch.empty(1))
        raise ValueError("midway")

    with pytest.raises(ValueError, match="midway"):
        capture(boom, backend="eager")
    assert not is_capturing()
    x, out, step = make_step()
    g = capture(step, backend="eager")
    g.replay()
    torch.testing.assert_close(out, (x + 1) * 4 + 1)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        capture(lambda: None, backend="tpu")  # type: ignore[arg-type]


def test_close_drops_replay():
    _, _, step = make_step()
    g = capture(step, backend="eager")
    g.close()
    g.replay()  # nothing left to run
    assert g.segments == []


class _FakeGraph:
    """torch.cuda.CUDAGraph's capture calls, recorded; `fail` names the call that raises, once: "end" (an
    invalidated capture) or "begin" (a pool that still records)."""

    calls: list[tuple] = []
    fail = ""

    def capture_begin(self, pool=None, capture_error_mode=None) -> None:
        self.calls.append(("begin", pool))
        if _FakeGraph.fail == "begin":
            _FakeGraph.fail = ""
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")

    def capture_end(self) -> None:
        self.calls.append(("end",))
        if _FakeGraph.fail == "end":
            _FakeGraph.fail = ""  # only the aborted capture's end fails
            raise RuntimeError("operation failed due to a previous error during capture")

    def reset(self) -> None:
        self.calls.append(("reset",))


@pytest.mark.parametrize("fail", ["end", "begin", ""])
def test_abort_ends_the_pools_recording_and_resets_the_generators_after_a_failed_call(monkeypatch, fail):
    """The control flow of _Capture.abort (the CUDA calls faked; tests/gpu/test_graphs_cuda.py invalidates a real
    capture): whatever failed, the pool's recording is ended; after a capture_begin or capture_end that failed
    (either can leave the CUDA generators capturing) one empty capture on a fresh pool runs to reset them; and
    a failed capture_end (which leaves the host allocator recording) spoils the pool for later captures."""
    from graphcache.graphs import capture as capture_module

    _FakeGraph.calls, _FakeGraph.fail = [], fail
    ended: list[tuple] = []
    monkeypatch.setattr(capture_module, "_spoiled_pools", set())
    monkeypatch.setattr(capture_module, "_spoiled_graphs", [])
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("fresh",))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch._C, "_cuda_endAllocateToPool", lambda dev, pool: ended.append(pool), raising=False
    )
    active = capture_module._Capture("cuda", pool=("shared",))
    if fail == "begin":
        with pytest.raises(RuntimeError, match="already recording"):
            active.begin_segment()
    else:
        active.begin_segment()
    active.abort()
    assert ended == [("shared",)]
    reset_capture = [("begin", ("fresh",)), ("end",), ("reset",)]
    tail = _FakeGraph.calls[2 if fail != "begin" else 1 :]  # after the aborted segment's begin (and end)
    assert tail[: len(reset_capture)] == (reset_capture if fail else [("reset",)])
    assert active.segments == [] and active.open_graph is None
    assert capture_module.pool_accepts_captures(("shared",)) == (fail != "end")
    assert len(capture_module._spoiled_graphs) == (fail == "end")  # kept alive: torch still points at it

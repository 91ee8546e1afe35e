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

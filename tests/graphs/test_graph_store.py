"""The graph store apart from its policy: it holds no reference to the policy and imports nothing of it,
and it gets, captures, holds, replays, drops and lists entries driven by plain calls (eager backend)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from graphcache.graphs import policy as policy_package
from graphcache.graphs.backend import CudaBackend, EagerBackend, make_backend
from graphcache.graphs.cache import GraphCache
from graphcache.graphs.capture import eager_break, is_capturing
from graphcache.graphs.descriptor import BatchDescriptor as D
from graphcache.graphs.policy.agreement import Agreement
from graphcache.graphs.policy.config import CachePolicyConfig
from graphcache.graphs.store import GraphStore

GRAPHS = Path(inspect.getfile(GraphStore)).parent
POLICY = Path(policy_package.__file__).parent


def _graphcache_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("graphcache"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("graphcache")}
    return found


def test_store_modules_import_nothing_from_the_policy():
    # Every module at graphs/ top but cache.py (which builds both) is the store's or shared by both.
    store_side = [p for p in GRAPHS.glob("*.py") if p.name not in ("__init__.py", "cache.py")]
    assert {"store.py", "backend.py", "pool_ledger.py", "entry.py"} <= {p.name for p in store_side}
    bad = {
        p.name: sorted(m for m in _graphcache_imports(p) if m.startswith("graphcache.graphs.policy"))
        for p in store_side
    }
    assert not any(bad.values()), f"store modules import the policy: {bad}"
    # and the policy never reaches up to the cache that builds it
    up = {p.name: _graphcache_imports(p) & {"graphcache.graphs.cache"} for p in POLICY.glob("*.py")}
    assert not any(up.values()), up


def _is_policy_object(value: object) -> bool:
    owner = getattr(value, "__self__", value)  # a bound method is a callback into its object
    return type(owner).__module__.startswith("graphcache.graphs.policy")


@pytest.mark.parametrize("agreement", [None, Agreement()])
def test_the_store_holds_no_policy_reference(agreement):
    cache = GraphCache(
        lambda d: None,
        backend="eager",
        config=CachePolicyConfig(max_entries=4, max_bytes=1 << 30),
        agreement=agreement,
    )
    cache.run(D(4, 4, True))
    store = cache.store
    held = [*vars(store).values(), *vars(store.pools).values(), *store.entries()]
    held += [v for e in store.entries() for v in vars(e).values()]
    offenders = [repr(v) for v in held if _is_policy_object(v)]
    assert not offenders, f"the store holds policy objects: {offenders}"
    for fn in (store.measure_bytes, store.step_fn):  # injected functions close over no policy either
        cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
        assert not [c for c in cells if _is_policy_object(c)]
    # ... while the policy holds the store it decides for
    assert cache.policy.store is store and cache.policy.budget.store is store


@eager_break
def _cumsum_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x.cumsum(0))


def test_store_alone_captures_holds_replays_drops_and_lists():
    x, mid, out = torch.randn(8), torch.empty(8), torch.empty(8)
    calls: list[D] = []

    def step(desc: D) -> None:
        calls.append(desc)
        _cumsum_into(x * 2, mid)
        out.copy_(mid + 1)

    ticks = iter(range(100))
    store = GraphStore(
        step,
        make_backend("eager"),
        clock=lambda: float(next(ticks)),
        measure_bytes=lambda d, h: 10 * d.num_tokens,
    )
    a, b = D(4, 4, True), D(8, 8, True)
    attempt = store.capture(a, "lazy")
    assert not attempt.failed and attempt.bytes == 40 and attempt.seconds == 1.0 and attempt.graph is not None
    assert a not in store and store.get(a) is None  # captured, not held
    entry, growth = store.hold(attempt, size=attempt.bytes, rank_bytes=(40,), seconds=1.0, pinned=False)
    assert (entry.bytes, growth, attempt.pool.graphs) == (40, (40,), 1)
    store.add(entry)
    second = store.capture(b, "lazy")  # into the live shared pool
    assert second.pool is attempt.pool
    store.add(store.hold(second, size=80, rank_bytes=(80,), seconds=1.0, pinned=True)[0])
    assert store.descriptors() == [a, b] and store.total_bytes() == 80 == store.pools.kind_bytes("lazy")

    store.replay(entry)  # a replay makes `a` the most recently used
    assert store.descriptors() == [b, a] and [e.desc for e in store.entries()] == [b, a]
    x.copy_(torch.randn(8))
    store.replay(store.get(a))
    torch.testing.assert_close(out, (x * 2).cumsum(0) + 1)

    dropped, freed = store.drop(b)
    assert dropped.desc == b and not freed and len(store) == 1  # `a` still holds the shared pool
    dropped, freed = store.drop(a)
    assert freed and len(store) == 0 and store.pools.live("lazy") is None and store.total_bytes() == 0


def test_store_reports_a_failed_capture_and_abandon_drops_its_empty_pool():
    def step(desc: D) -> None:
        if is_capturing():
            raise torch.OutOfMemoryError("injected")

    store = GraphStore(step, make_backend("eager"), clock=lambda: 0.0)
    attempt = store.capture(D(2, 2, True), "lazy")
    assert (attempt.failed, attempt.graph) == ("oom", None) and "injected" in attempt.detail
    assert store.pools.live("lazy") is attempt.pool  # until the caller abandons it
    assert store.abandon(D(2, 2, True), "lazy", attempt) is None
    assert store.pools.live("lazy") is None and len(store) == 0


def test_backend_is_chosen_once_by_name():
    assert isinstance(make_backend("eager"), EagerBackend) and isinstance(make_backend("cuda"), CudaBackend)
    with pytest.raises(ValueError, match="backend must be 'cuda' or 'eager'"):
        make_backend("tpu")
    with pytest.raises(ValueError, match="backend must be 'cuda' or 'eager'"):
        GraphCache(lambda d: None, backend="tpu", config=CachePolicyConfig(max_entries=1, max_bytes=1))  # type: ignore[arg-type]
    eager = make_backend("eager")
    assert eager.new_pool() != eager.new_pool() and eager.pool_bytes(eager.new_pool()) == 0

"""The graph cache's policy apart from its store: one validated config built from Settings, the
agreement wrapper, and the forward context that carries the step's descriptor and runtime mode."""

import pytest
from graphcache.config import Settings
from graphcache.graphs.cache import GraphCache
from graphcache.graphs.descriptor import BatchDescriptor as D
from graphcache.graphs.policy.agreed_policy import AgreedPolicy
from graphcache.graphs.policy.agreement import Agreement, CaptureReport, decide
from graphcache.graphs.policy.config import CachePolicyConfig, policy_config_from
from graphcache.graphs.policy.policy import CachePolicy
from graphcache.model.forward_context import (
    current_attention_metadata,
    current_forward_context,
    current_runtime_mode,
    forward_context,
)


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("admission", "sometimes"),
        ("capture_time_share", 0.0),
        ("eviction_policy", "lfu"),
        ("pin_share", 1.5),
        ("lazy_pool", "pooled"),
        ("capture_warmup", "never"),
    ],
)
def test_config_refuses_a_bad_knob_naming_it(knob, value):
    with pytest.raises(ValueError, match=knob.replace("_", ".")):
        CachePolicyConfig(max_entries=4, max_bytes=1 << 20, **{knob: value})


def test_config_from_settings_copies_every_cache_knob():
    s = Settings(
        cache_max_entries=7,
        cache_max_bytes=12345,
        admission="after_n",
        admission_min_misses=5,
        capture_time_share=0.3,
        capture_burst_seconds=0.7,
        eviction_policy="gdsf",
        cache_pin_share=0.25,
        cache_lazy_pool="private",
        capture_warmup="always",
    )
    assert policy_config_from(s.graph_cache) == CachePolicyConfig(
        max_entries=7,
        max_bytes=12345,
        admission="after_n",
        admission_min_misses=5,
        capture_time_share=0.3,
        capture_burst_seconds=0.7,
        eviction_policy="gdsf",
        pin_share=0.25,
        lazy_pool="private",
        capture_warmup="always",
    )


def test_store_takes_a_plain_policy_alone_and_wraps_it_for_an_agreement():
    config = CachePolicyConfig(max_entries=4, max_bytes=1 << 30)
    alone = GraphCache(lambda d: None, backend="eager", config=config)
    assert type(alone.policy) is CachePolicy and alone.policy.size == 1
    agreed = GraphCache(lambda d: None, backend="eager", config=config, agreement=Agreement())
    assert isinstance(agreed.policy, AgreedPolicy) and agreed.policy.config is config
    assert agreed.run(D(4, 4, True)) == "replay" and agreed.store.pools.live("lazy") is not None


def test_agreed_policy_raises_when_the_ranks_diverged():
    class Diverged(Agreement):
        size = 2

        def agree(self, report):
            return decide([report, CaptureReport(True, state=report.state + 1)])

    cache = GraphCache(
        lambda d: None,
        backend="eager",
        config=CachePolicyConfig(max_entries=4, max_bytes=1 << 30),
        agreement=Diverged(),
    )
    with pytest.raises(RuntimeError, match="diverged.*restart the server"):
        cache.run(D(4, 4, True))


def test_forward_context_carries_descriptor_and_mode_and_restores_on_exit():
    outer, inner = object(), object()
    with forward_context(outer):
        assert current_runtime_mode() == "eager" and current_forward_context().descriptor is None
        with forward_context(inner, D(8, 8, True), "full"):
            ctx = current_forward_context()
            assert (ctx.attention, ctx.descriptor, ctx.mode) == (inner, D(8, 8, True), "full")
        assert current_attention_metadata() is outer and current_runtime_mode() == "eager"
    with pytest.raises(RuntimeError, match="no forward context"):
        current_forward_context()
    with pytest.raises(ValueError, match="full, breakable, eager"), forward_context(outer, None, "graph"):
        pass


@pytest.mark.parametrize("decode_mode", ["full", "breakable"])
def test_runner_step_context_names_its_descriptor_and_mode(tmp_path, decode_mode):
    """The step the cache captures sees its descriptor and runtime mode; in "full" the layer calls the decode
    kernel inside the graph (no eager break: a "full" entry), in "breakable" through the break."""
    from graphcache.engine.worker.runner import ModelRunner

    runner = ModelRunner(
        Settings(
            cache_dir=tmp_path,
            device="cpu",
            max_num_seqs=4,
            max_num_batched_tokens=64,
            warmup_decode_sizes=[],
            decode_capture_mode=decode_mode,
        )
    )
    assert runner._decode_path(True), "the CPU runner should take the decode path for uniform decode"
    seen = []
    real = runner._run_model

    def spy(t, r):
        ctx = current_forward_context()
        seen.append((ctx.descriptor, ctx.mode))
        real(t, r)

    runner._run_model = spy
    runner.capture([D(4, 4, True), D(8, 4)], pin=False)
    assert (D(4, 4, True), decode_mode) in seen and (D(8, 4), "breakable") in seen
    modes = {e.descriptor: e.mode for e in runner.cache.entries()}
    assert modes == {"4:4:decode": decode_mode, "8:4": "breakable"}

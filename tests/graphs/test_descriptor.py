"""Batch descriptors: string round trip, validation, padding to capture sizes."""

import pytest
from graphcache.graphs.descriptor import BatchDescriptor, CaptureSizes, descriptor_for
from graphcache.settings.graph_cache import default_capture_sizes


def test_str_parse_round_trip():
    for d in (BatchDescriptor(64, 8), BatchDescriptor(8, 8, True), BatchDescriptor(1, 1)):
        assert BatchDescriptor.parse(str(d)) == d
    assert str(BatchDescriptor(8, 8, True)) == "8:8:decode"
    assert str(BatchDescriptor(64, 8)) == "64:8"


def test_lora_variants_round_trip_and_order_after_their_plain_shape():
    variants = [
        BatchDescriptor(64, 8, lora=True),
        BatchDescriptor(8, 8, True, lora=True),
        BatchDescriptor(16, 16, False, True, lora=True),
    ]
    assert [str(d) for d in variants] == ["64:8:lora", "8:8:decode:lora", "16:16:verify:lora"]
    for d in variants:
        assert BatchDescriptor.parse(str(d)) == d
        assert d.with_lora(False) != d and d.with_lora(False).with_lora() == d and d.with_lora() is d
        assert d.with_lora(False) < d  # the same shape: plain first, then its LoRA variant
    assert BatchDescriptor(8, 8, True, lora=True) < BatchDescriptor(16, 16, True)  # the shape decides first
    assert len({BatchDescriptor(8, 8, True), BatchDescriptor(8, 8, True, lora=True)}) == 2


@pytest.mark.parametrize(
    "bad", ["", "8", "8:x", "8:8:prefill", "0:0", "4:8", "8:4:decode", "a:b:c:d", "8:8:lora:decode", "lora"]
)
def test_parse_rejects_bad_text(bad):
    with pytest.raises(ValueError):
        BatchDescriptor.parse(bad)


def test_frozen_hashable_ordered():
    a, b = BatchDescriptor(8, 8, True), BatchDescriptor(16, 4)
    assert {a: 1}[BatchDescriptor(8, 8, True)] == 1
    assert a < b
    with pytest.raises(AttributeError):
        a.num_tokens = 3  # type: ignore[misc]


def test_pad_and_max():
    sizes = CaptureSizes(default_capture_sizes(64))
    assert sizes.max == 64
    assert [sizes.pad(n) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert sizes.pad(65) is None
    with pytest.raises(ValueError):
        CaptureSizes([])


def test_descriptor_for_decode_and_mixed():
    sizes = CaptureSizes([1, 2, 4, 8, 16, 32])
    assert descriptor_for(3, 3, True, sizes) == BatchDescriptor(4, 4, True)
    # mixed: requests padded to the token size (one capture per token size), capped by max_reqs
    assert descriptor_for(20, 3, False, sizes) == BatchDescriptor(32, 32, False)
    assert descriptor_for(20, 3, False, sizes, max_reqs=8) == BatchDescriptor(32, 8, False)
    assert {descriptor_for(20, r, False, sizes) for r in range(1, 21)} == {BatchDescriptor(32, 32, False)}
    assert descriptor_for(33, 3, False, sizes) is None  # too many tokens: eager
    assert descriptor_for(40, 40, True, sizes) is None
    with pytest.raises(ValueError):
        descriptor_for(3, 4, False, sizes)

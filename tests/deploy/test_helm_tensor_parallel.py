"""The chart requests one GPU per tensor-parallel rank: gpu.count follows config.tensor_parallel_size."""

from __future__ import annotations

import pytest

from .conftest import CHART
from .test_helm import container, helm, render  # noqa: F401 (helm: skips without helm-python-sdk)


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def gpus(objs) -> tuple[int, int]:
    res = container(objs)["resources"]
    return res["requests"]["nvidia.com/gpu"], res["limits"]["nvidia.com/gpu"]


def test_gpu_count_follows_tensor_parallel_size(chart):
    assert gpus(render(chart)) == (1, 1)
    objs = render(chart, {"config": {"tensor_parallel_size": 2}})
    assert gpus(objs) == (2, 2)
    env = {e["name"]: e.get("value") for e in container(objs)["env"]}
    assert env["GRAPHCACHE_TENSOR_PARALLEL_SIZE"] == "2"


def test_explicit_gpu_count_wins_when_it_covers_every_rank(chart):
    assert gpus(render(chart, {"gpu": {"count": 4}, "config": {"tensor_parallel_size": 2}})) == (4, 4)


def test_too_few_gpus_for_the_ranks_fails_with_the_fix(chart):
    with pytest.raises(helm.HelmError, match="unset gpu.count"):
        render(chart, {"gpu": {"count": 1}, "config": {"tensor_parallel_size": 2}})

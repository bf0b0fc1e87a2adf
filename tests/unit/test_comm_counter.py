"""CommCounter against known tensors: exact calls and nccl-tests bytes per collective.

A one-rank gloo group runs every collective it supports for real; at world size 1 an
all-gather's output and a reduce-scatter's input are the size of the local tensor, so a second
group, torch's in-process ``fake`` backend at world size 4, tells the gathered output (4x) and
the unsharded input apart from the shard. Expected bytes are written out by hand: elements x
bytes per element.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from harness.measure.comm_counter import BUS_FACTOR, CommCounter


@pytest.fixture
def fake_world4() -> Iterator[None]:
    # torch's own test backend: collectives return at once, one process plays rank 0 of 4.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


# all_gather_into_tensor / reduce_scatter_tensor are deprecated aliases in torch 2.13 (same c10d ops).
_DEPRECATED_ALIASES = pytest.mark.filterwarnings("ignore::FutureWarning")


@_DEPRECATED_ALIASES
def test_gloo_world1_counts_calls_and_bytes_per_collective(gloo_world1) -> None:
    x = torch.ones(6, 5)  # 30 fp32 elements: 120 bytes
    h = torch.ones(7, dtype=torch.float16)  # 14 bytes
    d = torch.ones(3, dtype=torch.float64)  # 24 bytes
    counter = CommCounter()
    with counter:
        dist.all_reduce(x)
        dist.all_reduce(h)
        dist.all_reduce(d)
        out = torch.empty(6, 5)
        dist.all_gather_into_tensor(out, x)
        dist.all_gather([torch.empty(3, dtype=torch.float64)], d)
        dist.broadcast(x, src=0)
        dist.broadcast(h, src=0)
        dist.all_to_all_single(torch.empty(6, 5), x)
        dist.reduce(d, dst=0)
        dist.barrier()  # no payload: not a counted collective
        x.add_(1)  # not a collective at all
    assert dict(counter.counts) == {
        "all_reduce": [3, 120 + 14 + 24],
        "all_gather": [2, 120 + 24],
        "broadcast": [2, 120 + 14],
        "all_to_all": [1, 120],
        "reduce": [1, 24],
    }
    # The collectives ran: a sum over one rank leaves the ones as they were, then add_ made them 2.
    assert torch.equal(x, torch.full((6, 5), 2.0)) and torch.equal(out, torch.ones(6, 5))


def test_functional_collectives_are_counted_too(gloo_world1) -> None:
    x = torch.arange(12, dtype=torch.float32)  # 48 bytes
    counter = CommCounter()
    with counter:
        y = funcol.all_reduce(x, "sum", dist.group.WORLD)
        y = funcol.wait_tensor(y)
    assert dict(counter.counts) == {"all_reduce": [1, 48]}
    assert torch.equal(y, x)


@_DEPRECATED_ALIASES
def test_gather_counts_output_and_reduce_scatter_the_unsharded_input(fake_world4) -> None:
    shard = torch.ones(2, 3)  # 6 fp32 = 24 bytes; the gathered or unsharded tensor is 4 x that
    full = torch.ones(8, 3)  # 96 bytes
    counter = CommCounter()
    with counter:
        dist.all_gather_into_tensor(torch.empty(8, 3), shard)
        dist.all_gather([torch.empty(2, 3) for _ in range(4)], shard)
        dist.reduce_scatter_tensor(torch.empty(2, 3), full)
        dist.reduce_scatter(torch.empty(2, 3), [torch.ones(2, 3) for _ in range(4)])
        dist.all_to_all_single(torch.empty(8, 3), full)
        dist.all_reduce(shard)
        g = funcol.all_gather_tensor(shard, 0, dist.group.WORLD)
        rs = funcol.reduce_scatter_tensor(full, "sum", 0, dist.group.WORLD)
        funcol.wait_tensor(g)
        funcol.wait_tensor(rs)
    assert dict(counter.counts) == {
        "all_gather": [3, 96 + 96 + 96],
        "reduce_scatter": [3, 96 + 96 + 96],
        "all_to_all": [1, 96],
        "all_reduce": [1, 24],
    }


def test_disabled_reset_and_per_step(gloo_world1) -> None:
    x = torch.ones(10)  # 40 bytes
    counter = CommCounter()
    with counter:
        dist.all_reduce(x)
        counter.enabled = False
        dist.all_reduce(x)  # runs, but is not counted
        counter.enabled = True
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
    assert dict(counter.counts) == {"all_reduce": [2, 80], "broadcast": [1, 40]}
    assert counter.per_step(2) == {
        "all_reduce": {"calls_per_step": 1.0, "bytes_per_step": 40.0},
        "broadcast": {"calls_per_step": 0.5, "bytes_per_step": 20.0},
    }
    assert list(counter.per_step(1)) == ["all_reduce", "broadcast"]  # sorted by name
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        counter.per_step(0)
    counter.reset()
    assert dict(counter.counts) == {} and counter.per_step(1) == {}


def test_bus_factors_follow_nccl_tests() -> None:
    # nccl-tests PERFORMANCE.md: all_reduce 2(n-1)/n; gather, scatter, all-to-all (n-1)/n; else 1.
    assert BUS_FACTOR["all_reduce"](4) == 1.5
    assert BUS_FACTOR["all_reduce"](2) == 1.0
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        assert BUS_FACTOR[name](4) == 0.75, name
        assert BUS_FACTOR[name](8) == 0.875, name
    for name in ("broadcast", "reduce", "send", "recv", "send_recv"):
        assert BUS_FACTOR[name](4) == 1.0, name


def test_labelled_calls_are_filed_under_their_label_too(gloo_world1) -> None:
    """Calls inside ``comm_label("cp")`` count in the totals and under "cp"; the innermost label wins; calls outside
    any label are in the totals only. By hand: 3 all-reduces of 40 bytes, 2 of them under cp, 1 under pp."""
    from harness.comm_scope import comm_label

    x = torch.ones(10)  # 40 bytes
    counter = CommCounter()
    with counter:
        dist.all_reduce(x)
        with comm_label("cp"):
            dist.all_reduce(x)
            dist.broadcast(x, src=0)
            with comm_label("pp"):
                dist.all_reduce(x)
            dist.all_reduce(x)
    assert dict(counter.counts) == {"all_reduce": [4, 160], "broadcast": [1, 40]}
    assert counter.per_step_labelled("cp", 2) == {"all_reduce": {"calls_per_step": 1.0, "bytes_per_step": 40.0},
                                                  "broadcast": {"calls_per_step": 0.5, "bytes_per_step": 20.0}}
    assert counter.per_step_labelled("pp", 1) == {"all_reduce": {"calls_per_step": 1.0, "bytes_per_step": 40.0}}
    assert counter.per_step_labelled("ep", 1) == {}, "a label with no calls"
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        counter.per_step_labelled("cp", 0)


def test_an_op_named_like_a_collective_in_another_namespace_is_not_counted() -> None:
    """Only the c10d and _c10d_functional namespaces hold collectives: an op of another library that happens to be
    called ``all_reduce`` (defined here) is not one."""
    lib = torch.library.Library("harness_test_ns", "DEF")
    lib.define("all_reduce(Tensor x) -> Tensor")
    lib.impl("all_reduce", lambda x: x.clone(), "CPU")
    counter = CommCounter()
    with counter:
        torch.ops.harness_test_ns.all_reduce(torch.ones(4))
    assert dict(counter.counts) == {}

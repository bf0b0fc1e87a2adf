"""Expert parallel's dispatch and combine at exact values in one process (issue 44's mutation scope,
docs/mutation.md).

The ``ep`` ranks run as threads, each calling :class:`AllToAllDispatch` as its rank would; ``all_to_all_single``
is emulated: every rank posts its input and split sizes, and rank ``r`` receives, in peer order, the slice each
peer addressed to it (what the collective delivers). The expected values are written by hand from the layout
(rank r holds global experts ``r * n_local .. (r + 1) * n_local - 1``): which rows reach which expert, in which
order, the counters, and that combine brings every row home. The experts are stood in for by a multiplication
by ``1 + global expert id``, so a row that comes back from the wrong expert, or to the wrong slot, shows.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from harness import comm_scope
from harness.parallel import ep as ep_mod
from harness.parallel.ep import EP_LABEL, AllToAllDispatch, apply_ep, shard_experts
from workloads.moe import MoE
from workloads.sizes import MoESpec

GROUP = object()
"""Stands for the ep process group: the emulated collective checks it was handed it."""


class _Group:
    """The ep group's all-to-all for ``ep`` threads, one per rank."""

    def __init__(self, ep: int) -> None:
        self.ep = ep
        self.barrier = threading.Barrier(ep, timeout=30)
        self.posted: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self.local = threading.local()
        self.labels: list[str | None] = []

    def rank(self, group=None) -> int:
        assert group is GROUP, group
        return self.local.rank

    def all_to_all_single(self, out, inp, output_split_sizes=None, input_split_sizes=None, group=None):
        assert group is GROUP, group
        r = self.local.rank
        self.labels.append(comm_scope.current_label())
        sizes = input_split_sizes or [inp.shape[0] // self.ep] * self.ep
        self.posted[r] = (inp.detach().clone(), list(sizes))
        self.barrier.wait()
        pieces = []
        for p in range(self.ep):
            x, split = self.posted[p]
            start = sum(split[:r])
            pieces.append(x[start:start + split[r]])
        got = torch.cat(pieces)
        expected = output_split_sizes or [out.shape[0] // self.ep] * self.ep  # None: equal parts, as torch reads it
        assert [len(x) for x in pieces] == list(expected), "the receive splits the rank gave are what its peers sent"
        out.copy_(got)
        self.barrier.wait()  # every rank has read before the next call posts again

    def run(self, monkeypatch, fn) -> list:
        """``fn(rank)`` on every rank at once; their results in rank order."""
        monkeypatch.setattr(dist, "get_rank", self.rank)
        monkeypatch.setattr(dist, "all_to_all_single", self.all_to_all_single)
        results: list = [None] * self.ep
        errors: list[BaseException] = []

        def body(r: int) -> None:
            self.local.rank = r
            try:
                results[r] = fn(r)
            except BaseException as e:  # re-raised on the test's thread below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.ep)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _rank_rows(rank: int, counts: list[int], d: int) -> torch.Tensor:
    """Rank ``rank``'s rows grouped by expert: row i of expert e is ``[rank, e, i, ...]`` (a label per row)."""
    rows = [torch.tensor([rank, e, i] + [0] * (d - 3), dtype=torch.float64) for e, n in enumerate(counts) for i in range(n)]
    return torch.stack(rows) if rows else torch.zeros(0, d, dtype=torch.float64)


COUNTS = {  # per rank, rows per global expert: uneven, some zero, so a misordered split shows
    2: [[2, 0, 1, 3], [1, 2, 0, 1]],
    4: [[1, 0, 2, 1, 0, 3, 1, 0], [0, 2, 1, 0, 1, 1, 0, 2], [3, 1, 0, 0, 2, 0, 1, 1], [0, 0, 1, 2, 1, 0, 0, 1]],
}


@pytest.mark.parametrize("ep", [2, 4])
def test_each_expert_gets_its_rows_from_every_peer_in_peer_order_and_they_come_back_home(monkeypatch, ep):
    counts = COUNTS[ep]
    n_experts, d = len(counts[0]), 4
    n_local = n_experts // ep
    group = _Group(ep)

    def rank_fn(r: int):
        disp = AllToAllDispatch(GROUP, ep, n_experts)
        grouped = _rank_rows(r, counts[r], d).requires_grad_(True)
        rows, local_counts, state = disp.dispatch(grouped, torch.tensor(counts[r]), even=False)
        scale = torch.cat([torch.full((n, 1), 1.0 + r * n_local + j, dtype=torch.float64)
                           for j, n in enumerate(local_counts)])
        back = disp.combine(rows * scale, state)
        back.sum().backward()
        once = disp.take_counts()
        for _ in range(2):  # two micro-batches: the counters add up until taken
            disp.combine(disp.dispatch(grouped.detach(), torch.tensor(counts[r]), even=False)[0], state)
        return rows.detach(), local_counts, back.detach(), grouped.grad, once, disp.take_counts(), disp.take_counts()

    for r, (rows, local_counts, back, grad, taken, twice, again) in enumerate(group.run(monkeypatch, rank_fn)):
        experts = range(r * n_local, (r + 1) * n_local)
        # by hand: local expert j receives from peer 0, 1, ... each peer's rows of global expert r * n_local + j
        expected = [(p, e, i) for e in experts for p in range(ep) for i in range(counts[p][e])]
        assert [tuple(int(v) for v in row[:3]) for row in rows] == expected
        assert local_counts == [sum(counts[p][e] for p in range(ep)) for e in experts]
        # every row is home, in its place, scaled by 1 + the global expert that computed it; so is its gradient
        factor = torch.tensor([1.0 + e for e, n in enumerate(counts[r]) for _ in range(n)], dtype=torch.float64)
        assert torch.equal(back, _rank_rows(r, counts[r], d) * factor.unsqueeze(1))
        assert torch.equal(grad, factor.unsqueeze(1).expand(-1, d))
        mine = sum(counts[r][e] for e in experts)
        assert taken == (sum(counts[r]), sum(counts[r]) - mine, sum(local_counts))  # routed, left, received
        assert twice == tuple(2 * n for n in taken) and again == (0, 0, 0), "they add up, and taking restarts them"
    # the counts' exchange and every all-to-all (forward and backward) are filed under ep's label
    assert group.labels and set(group.labels) == {EP_LABEL}
    # per rank: counts, rows out, outputs back and each exchange's reverse; then two micro-batches of three
    assert len(group.labels) == 11 * ep


@pytest.mark.parametrize("ep", [2, 4])
def test_even_splits_need_no_counts_exchange(monkeypatch, ep):
    """Fake-tensor runs (``even``): every rank splits its rows evenly over the ranks and each rank's share evenly
    over its experts, the larger parts first, with no exchange of counts."""
    n_experts, rows_per_rank, d = 2 * ep, 4 * ep + 3, 4
    group = _Group(ep)

    def rank_fn(r: int):
        disp = AllToAllDispatch(GROUP, ep, n_experts)
        grouped = torch.arange(rows_per_rank * d, dtype=torch.float64).view(rows_per_rank, d) + 1000 * r
        rows, local_counts, state = disp.dispatch(grouped, torch.zeros(n_experts, dtype=torch.int64), even=True)
        return grouped, rows, local_counts, disp.combine(rows, state)

    q, extra = divmod(rows_per_rank, ep)
    send = [q + 1] * extra + [q] * (ep - extra)  # even_split by hand
    for r, (grouped, rows, local_counts, back) in enumerate(group.run(monkeypatch, rank_fn)):
        share = send[r]
        assert local_counts == [ep * ((share + 1) // 2), ep * (share // 2)]  # each peer's share in two, larger first
        assert rows.shape[0] == ep * share
        assert torch.equal(back, grouped), "combine undoes dispatch"
    assert len(group.labels) == 2 * ep, "rows out and back only: no counts exchanged"


def test_the_tp_variant_sums_partial_outputs_and_row_gradients_over_tp(monkeypatch):
    """Under fsdp+tp+ep the rows go to the tp group whole (forward identity) and come back summed over it; the
    rows' gradients are summed over tp on the way back. One ep rank, a tp group of 2 emulated by doubling."""
    reduced: list[torch.Tensor] = []

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        assert group == "tp"
        reduced.append(t.clone())
        t.mul_(2)  # the other tp rank holds the same partial sum here

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    group = _Group(1)

    def rank_fn(r: int):
        disp = AllToAllDispatch(GROUP, 1, 2, tp_group="tp")
        grouped = torch.ones(3, 2, dtype=torch.float64, requires_grad=True)
        rows, local_counts, state = disp.dispatch(grouped, torch.tensor([2, 1]), even=False)
        back = disp.combine(rows * 3, state)
        back.sum().backward()
        return back.detach(), grouped.grad, local_counts

    [(back, grad, local_counts)] = group.run(monkeypatch, rank_fn)
    assert local_counts == [2, 1]
    assert torch.equal(back, torch.full((3, 2), 6.0, dtype=torch.float64))  # 3 x the row, summed over 2 tp ranks
    assert torch.equal(grad, torch.full((3, 2), 6.0, dtype=torch.float64))  # d/dx of 2 x 3 x, summed over tp again
    assert len(reduced) == 2, "one all-reduce forward (outputs), one backward (row gradients)"
    assert ep_mod.EP_LABEL == "ep"


class _Dims:
    """The expert-parallel dims on one rank: an (ep, tp) mesh of 1 x 1 (what apply_ep reads of ParallelDims)."""

    def __init__(self, tp_enabled: bool) -> None:
        self.mesh_2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("ep", "tp"))
        self.tp_enabled, self.ep = tp_enabled, 1

    def mesh(self, *names: str):
        return self.mesh_2d[names if len(names) > 1 else names[0]]


@pytest.mark.parametrize("tp", [False, True])
def test_apply_ep_shards_every_moe_layers_experts_and_gives_each_a_dispatcher(gloo_world1, tp):
    """By hand: each stacked expert weight a DTensor split over the experts (dim 0) on the ep mesh; under tp its
    width too, gate and up on dim 1 (column-wise), proj on dim 2 (row-wise); every MoE layer, none else."""
    spec = MoESpec(n_experts=2, top_k=1, d_ff=4)
    part = nn.ModuleDict({"a": MoE(8, spec), "b": nn.Sequential(MoE(8, spec)), "c": nn.Linear(8, 8)})
    dims = _Dims(tp)
    apply_ep(part, dims)
    for layer in (part["a"], part["b"][0]):
        for name, width_dim in (("gate", 1), ("up", 1), ("proj", 2)):
            w = getattr(layer.experts, name)
            assert isinstance(w, DTensor) and isinstance(w, nn.Parameter), name
            assert w.placements == ((Shard(0), Shard(width_dim)) if tp else (Shard(0),)), (name, w.placements)
            assert w.device_mesh.mesh_dim_names == (("ep", "tp") if tp else ("ep",))
        d = layer.dispatcher
        assert isinstance(d, AllToAllDispatch) and (d.ep, d.n_local) == (1, 2)
        assert (d.tp_group is not None) == tp and d.group is not None
    assert not isinstance(part["c"].weight, DTensor)


def test_shard_experts_divides_the_experts_gradient_by_every_data_parallel_rank(gloo_world1):
    """On a 1-rank efsdp mesh FSDP reduces nothing and divides by the factor: the experts' gradient is the plain
    one over ``dp_ranks`` (4 here: efsdp x ep), the data-parallel mean of a world of 4 by hand."""
    torch.manual_seed(0)
    spec = MoESpec(n_experts=2, top_k=1, d_ff=4)
    plain = nn.ModuleDict({"mlp": MoE(8, spec)})
    for p in plain.parameters():
        nn.init.normal_(p, std=0.1)
    sharded = copy.deepcopy(plain)
    x = torch.randn(2, 3, 8)
    plain["mlp"](x).sum().backward()
    shard_experts(sharded, init_device_mesh("cpu", (1,)), dp_ranks=4, reshard_after_forward=True,
                  mp_policy=MixedPrecisionPolicy())
    assert isinstance(sharded["mlp"].experts, FSDPModule) and not isinstance(sharded["mlp"].router, FSDPModule)
    sharded["mlp"](x).sum().backward()
    for name in ("gate", "up", "proj"):
        got = getattr(sharded["mlp"].experts, name).grad.full_tensor()
        assert torch.allclose(got, getattr(plain["mlp"].experts, name).grad / 4, atol=1e-7), name


@pytest.mark.parametrize(("backend", "size", "force_sum"), [("gloo", 2, True), ("gloo", 1, False), ("nccl", 2, False)])
def test_shard_experts_asks_fsdp_for_what_the_backend_can_do(monkeypatch, backend, size, force_sum):
    """What shard_experts hands FSDP, recorded: the experts of every MoE layer, on the efsdp mesh, with the caller's
    resharding and precision; the gradient divided by dp_ranks; and a sum then divide (no PREMUL_SUM) on gloo groups
    of more than one rank, where gloo lacks NCCL's premultiplied sum."""
    calls: list[tuple] = []

    class _Sharded:
        def set_gradient_divide_factor(self, f):
            calls.append(("divide", f))

        def set_force_sum_reduction_for_comms(self, on):
            calls.append(("force_sum", on))

    class _Mesh:
        def get_group(self):
            return "efsdp-group"

        def size(self):
            return size

    mesh, policy = _Mesh(), object()

    def fully_shard(module, *, mesh, reshard_after_forward, mp_policy):
        calls.append(("shard", module, mesh, reshard_after_forward, mp_policy))
        return _Sharded()

    monkeypatch.setattr(ep_mod, "fully_shard", fully_shard)
    monkeypatch.setattr(dist, "get_backend", lambda group: {"efsdp-group": backend}[group])
    spec = MoESpec(n_experts=2, top_k=1, d_ff=4)
    part = nn.ModuleDict({"a": MoE(8, spec), "b": MoE(8, spec)})
    shard_experts(part, mesh, dp_ranks=6, reshard_after_forward=False, mp_policy=policy)
    per_layer = [[("shard", layer.experts, mesh, False, policy), ("divide", 6.0), ("force_sum", force_sum)]
                 for layer in (part["a"], part["b"])]
    assert calls == per_layer[0] + per_layer[1]
    assert isinstance(calls[1][1], float)

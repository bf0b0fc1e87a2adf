"""Context parallel's attention at exact values in one process (issue 44's mutation scope, docs/mutation.md).

The ranks' K/V all-gather and its backward reduce-scatter are emulated: the all-gather hands rank ``r`` every
rank's stacked (k, v) in rank order (what ``all_gather_single`` delivers), the reduce-scatter gives it its own
slice of the gradient with the other ranks contributing zero (their queries are not run here). The reference
is torch's own causal ``scaled_dot_product_attention`` over the whole sequence, and each rank's positions
are written by hand from the head-tail layout (rank r holds chunks r and 2 cp - 1 - r).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness import comm_scope
from harness.parallel import cp as cp_mod
from harness.parallel.cp import (
    CP_LABEL,
    SequenceShard,
    apply_cp,
    causal_bias,
    causal_work,
    chunk_attention,
    head_tail_chunks,
    natural_order,
    shard_indices,
    shard_sequence,
)

GROUP = object()
"""Stands for the CP process group: the emulated collectives check they were handed it."""


def _by_hand(seq_len: int, rank: int, cp: int) -> list[int]:
    """Rank ``rank``'s positions: chunk r, then chunk 2 cp - 1 - r, each seq_len / (2 cp) long."""
    c = seq_len // (2 * cp)
    tail = 2 * cp - 1 - rank
    return list(range(rank * c, (rank + 1) * c)) + list(range(tail * c, (tail + 1) * c))


class _Emulated:
    """The CP group's collectives for rank ``rank`` of ``cp``, every other rank's local (k, v) given."""

    def __init__(self, monkeypatch, rank: int, cp: int, k_full: torch.Tensor, v_full: torch.Tensor) -> None:
        self.rank, self.cp = rank, cp
        t = k_full.shape[2]
        # each rank's k and v side by side along the head width, one leading axis to gather along
        self.locals = [torch.cat((k_full[:, :, _by_hand(t, r, cp)], v_full[:, :, _by_hand(t, r, cp)]), dim=-1)[None]
                       for r in range(cp)]
        self.width = k_full.shape[-1]
        self.calls: list[tuple] = []
        monkeypatch.setattr(cp_mod, "_ALL_GATHER", self.all_gather)
        monkeypatch.setattr(cp_mod, "_REDUCE_SCATTER", self.reduce_scatter)
        monkeypatch.setattr(dist, "get_world_size", self.world_size)

    def world_size(self, group=None) -> int:
        assert group is GROUP, group
        return self.cp

    def all_gather(self, out, local, group=None):
        self.calls.append(("all_gather", comm_scope.current_label(), group, tuple(out.shape)))
        parts = [local if r == self.rank else self.locals[r] for r in range(self.cp)]
        out.copy_(torch.cat(parts))

    def reduce_scatter(self, out, grad, op=dist.ReduceOp.SUM, group=None):  # torch's default op
        self.calls.append(("reduce_scatter", comm_scope.current_label(), group, tuple(out.shape), op))
        out.copy_(grad.chunk(self.cp)[self.rank])


@pytest.mark.parametrize("cp", [2, 4])
def test_gather_returns_the_whole_sequences_k_and_v_in_order(monkeypatch, cp):
    """B, H, T and hd all differ, so a swapped axis in the regrouping shows."""
    b, h, t, hd = 2, 3, 4 * cp, 5
    k_full = torch.randn(b, h, t, hd, generator=torch.Generator().manual_seed(cp))
    v_full = torch.randn(b, h, t, hd, generator=torch.Generator().manual_seed(cp + 10))
    for rank in range(cp):
        em = _Emulated(monkeypatch, rank, cp, k_full, v_full)
        k, v = em.locals[rank][0, ..., :hd], em.locals[rank][0, ..., hd:]
        kf, vf = SequenceShard(rank=rank, size=cp, group=GROUP).gather(k, v)
        assert torch.equal(kf, k_full) and torch.equal(vf, v_full), rank
        # one all-gather of k and v side by side: (cp, B, H, 2c, 2 hd), filed under cp
        assert em.calls == [("all_gather", CP_LABEL, GROUP, (cp, b, h, t // cp, 2 * hd))]


@pytest.mark.parametrize("cp,rank,c", [(2, 0, 2), (2, 1, 2), (4, 1, 2), (4, 3, 2), (2, 1, 1)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_and_its_gradients_equal_torchs_causal_attention_at_the_ranks_positions(monkeypatch, cp, rank, c,
                                                                                          kv_heads):
    """Forward and backward of one rank's queries against torch's causal SDPA over the whole sequence (4 query
    heads; 2 kv heads is grouped-query attention); the k and v gradients are those of this rank's queries only,
    as the emulated reduce-scatter adds nothing from the others. ``c`` tokens per chunk: at c = 1 a rank holds
    2 tokens, as many as the 2 kv heads, so the head count cannot be confused with the length."""
    b, hq, t, hd = 2, 4, 2 * cp * c, 8
    g = torch.Generator().manual_seed(7 * cp + rank)
    q_full = torch.randn(b, hq, t, hd, generator=g, dtype=torch.float64, requires_grad=True)
    k_full = torch.randn(b, kv_heads, t, hd, generator=g, dtype=torch.float64, requires_grad=True)
    v_full = torch.randn(b, kv_heads, t, hd, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(b, hq, t // cp, hd, generator=g, dtype=torch.float64)
    mine = _by_hand(t, rank, cp)

    ref = F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=True, enable_gqa=kv_heads != hq)
    (ref[:, :, mine] * w).sum().backward()

    em = _Emulated(monkeypatch, rank, cp, k_full.detach(), v_full.detach())
    q, k, v = (x.detach()[:, :, mine].clone().requires_grad_() for x in (q_full, k_full, v_full))
    out = SequenceShard(rank=rank, size=cp, group=GROUP).attention(q, k, v)
    (out * w).sum().backward()

    torch.testing.assert_close(out, ref.detach()[:, :, mine])
    torch.testing.assert_close(q.grad, q_full.grad[:, :, mine])
    torch.testing.assert_close(k.grad, k_full.grad[:, :, mine])
    torch.testing.assert_close(v.grad, v_full.grad[:, :, mine])
    # backward: one reduce-scatter to this rank's (1, B, Hkv, 2c, 2 hd), summed, filed under cp
    assert em.calls[-1] == ("reduce_scatter", CP_LABEL, GROUP, (1, b, kv_heads, t // cp, 2 * hd), dist.ReduceOp.SUM)


def test_attention_makes_its_mask_on_the_queries_device(monkeypatch):
    """On the meta device (shapes only): a mask made anywhere else than the queries' device is refused by SDPA."""
    k_full = torch.empty(1, 2, 8, 4, device="meta")
    _Emulated(monkeypatch, 1, 2, k_full, k_full)
    q = torch.empty(1, 2, 4, 4, device="meta")
    out = SequenceShard(rank=1, size=2, group=GROUP).attention(q, q, q)
    assert out.device.type == "meta" and out.shape == (1, 2, 4, 4)


def test_the_gathers_are_named_for_the_step_composition(monkeypatch):
    """The profiler annotations the step composition files as CP's exposed time (CP_TRACE_NAME + the op)."""
    from torch.profiler import ProfilerActivity, profile

    k_full = torch.randn(1, 1, 8, 2)
    _Emulated(monkeypatch, 0, 2, k_full, k_full)
    k = k_full[:, :, _by_hand(8, 0, 2)].clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        kf, vf = SequenceShard(rank=0, size=2, group=GROUP).gather(k, k)
        (kf.sum() + vf.sum()).backward()
    names = {e.name for e in prof.events()}
    assert {"cp_kv_all_gather", "cp_kv_reduce_scatter"} <= names, sorted(n for n in names if "cp" in n)


@pytest.mark.parametrize("lower_right", [False, True])
@pytest.mark.parametrize("c,end,kv_heads", [(3, 3, 2), (2, 6, 4), (4, 8, 2)])
def test_chunk_attention_either_way_equals_the_last_rows_of_causal_attention(c, end, kv_heads, lower_right):
    """Both masks (the GPU's lower-right causal bias, the CPU's reversed view) give the last ``c`` rows of torch's
    causal SDPA over ``end`` positions, and their gradients; c = end is the diagonal chunk."""
    g = torch.Generator().manual_seed(c * end)
    q_full = torch.randn(1, 4, end, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, end, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, end, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 4, c, 8, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q_full, k, v, is_causal=True, enable_gqa=kv_heads != 4)[:, :, end - c:]
    ref_grads = torch.autograd.grad((ref * w).sum(), (q_full, k, v))
    q = q_full.detach()[:, :, end - c:].clone().requires_grad_()
    out = chunk_attention(q, k, v, kv_heads != 4, lower_right=lower_right)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grads[0], ref_grads[0][:, :, end - c:])
    torch.testing.assert_close(grads[1:], ref_grads[1:])


def test_the_lower_right_chunk_passes_a_causal_bias_and_no_mask_tensor(monkeypatch):
    """The GPU's way: SDPA gets torch's lower-right ``CausalBias`` (flash attention's own causal mask, no tensor)
    and the queries unflipped; a rank picks it by its queries' device (CPU and meta take the reversed view). SDPA is
    spied on, so no GPU is needed to see what it is handed."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    seen: list = []

    def spy(q, k, v, attn_mask=None, enable_gqa=False):
        seen.append(attn_mask)
        return q.new_zeros(q.shape)

    monkeypatch.setattr(cp_mod.F, "scaled_dot_product_attention", spy)
    q, k = torch.empty(1, 2, 2, 4, device="meta"), torch.empty(1, 2, 6, 4, device="meta")
    chunk_attention(q, k, k, False, lower_right=True)
    (mask,) = seen
    assert isinstance(mask, CausalBias) and mask.variant == CausalVariant.LOWER_RIGHT
    assert (mask.seq_len_q, mask.seq_len_kv) == (2, 6)
    calls: list[bool] = []
    monkeypatch.setattr(cp_mod, "chunk_attention", lambda q, k, v, gqa, *, lower_right: calls.append(lower_right) or q)
    _Emulated(monkeypatch, 1, 2, torch.empty(1, 2, 8, 4, device="meta"), torch.empty(1, 2, 8, 4, device="meta"))
    local = torch.empty(1, 2, 4, 4, device="meta")
    SequenceShard(rank=1, size=2, group=GROUP).attention(local, local, local)
    assert calls == [False, False]  # two chunks, neither on CUDA


@pytest.mark.parametrize("c,end", [(3, 3), (2, 6), (4, 8)])
def test_causal_bias_is_zero_up_to_each_reversed_query_and_minus_inf_after(c, end):
    """Row i is query end - 1 - i (rows reversed): it sees keys k <= end - 1 - i, by hand."""
    bias = causal_bias(c, end, torch.float64, "cpu")
    expected = torch.tensor([[0.0 if k <= end - 1 - i else float("-inf") for k in range(end)] for i in range(c)],
                            dtype=torch.float64)
    assert bias.dtype == torch.float64 and bias.shape == (c, end)
    assert torch.equal(bias, expected)
    assert causal_bias(c, end, torch.float16, "meta").device.type == "meta"


def test_positions_are_the_ranks_global_positions_on_the_asked_device():
    """Rank 1 of 2 holding 4 local tokens of 8: chunks 1 and 2 (of 4, 2 tokens each) -> 2, 3, 4, 5."""
    shard = SequenceShard(rank=1, size=2)
    assert shard.positions(4, "cpu").tolist() == [2, 3, 4, 5]
    assert SequenceShard(rank=2, size=3).positions(4, "cpu").tolist() == [4, 5, 6, 7]  # chunks 2 and 3 of 6
    assert shard.positions(4, "meta").device.type == "meta"


def test_shard_indices_are_made_on_the_asked_device_and_the_sequence_asks_for_its_own(monkeypatch):
    """No host-to-device copy in the step: the index tensor is made where the tokens are."""
    assert shard_indices(8, 0, 2, device="meta").device.type == "meta"
    asked = []
    real = cp_mod.shard_indices
    monkeypatch.setattr(cp_mod, "shard_indices", lambda *a, **k: asked.append((a, k)) or real(*a, **k))
    t = torch.arange(16).view(2, 8)
    assert shard_sequence(t, 1, 2).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]  # by hand: positions 2..5
    assert asked == [((8, 1, 2, t.device), {})]


def test_a_rank_outside_the_group_and_an_unsplittable_length_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^cp rank 2 outside 0\.\.1$"):
        head_tail_chunks(2, 2)
    with pytest.raises(ValueError, match=r"^cp rank -1 outside 0\.\.3$"):
        head_tail_chunks(-1, 4)
    # 6 tokens over cp 2 = 4 chunks does not split (a division in place of 2 x cp would let it through)
    with pytest.raises(ValueError, match=r"^seq_len \(6\) must be divisible by 2 x cp \(4\)$"):
        shard_indices(6, 0, 2)
    assert head_tail_chunks(2, 3) == (2, 3)  # the last rank: chunk 2 and its mirror 2 x 3 - 1 - 2


@pytest.mark.parametrize("rank,cp,chunk,pairs", [
    (0, 1, 3, 1 + 2 + 3 + 4 + 5 + 6),  # one rank holds the whole 6-token sequence: query p sees p + 1 keys
    (0, 2, 2, (1 + 2) + (7 + 8)),  # chunks 0 (positions 0-1) and 3 (6-7)
    (1, 2, 2, (3 + 4) + (5 + 6)),  # chunks 1 (2-3) and 2 (4-5)
    (1, 3, 1, 2 + 5),  # chunks 1 and 4 of 6, one token each
])
def test_causal_work_counts_query_key_pairs_by_hand(rank, cp, chunk, pairs):
    assert causal_work(rank, cp, chunk) == pairs


def test_natural_order_along_an_inner_dimension():
    """Rank-major gather of cp 2 along dim 1: rank 0's chunks 0 and 3, then rank 1's 1 and 2 -> 0, 1, 2, 3."""
    gathered = torch.tensor([[0, 3, 1, 2], [10, 13, 11, 12]]).unsqueeze(-1)  # (B=2, 2 cp, 1)
    assert natural_order(gathered, 1).squeeze(-1).tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]


class _FakeMesh:
    """What apply_cp reads of a 1-D CP mesh."""

    def get_local_rank(self) -> int:
        return 2

    def size(self) -> int:
        return 4

    def get_group(self):
        return GROUP


def test_apply_cp_attaches_one_shard_to_every_module_that_takes_one():
    class Takes(nn.Module):
        seq_shard = None

    model = nn.Sequential(Takes(), nn.Linear(2, 2), nn.Sequential(Takes()))
    shard = apply_cp(model, _FakeMesh())
    assert shard == SequenceShard(rank=2, size=4, group=GROUP)
    assert model[0].seq_shard is shard and model[2][0].seq_shard is shard
    assert not hasattr(model[1], "seq_shard")


def test_the_gpu_checks_chunk_script_runs_both_ways_at_parity_on_the_cpu():
    """scripts/cp_chunk_attention.py (scripts/gpu_checks.sh's CP phase) at a small size on the CPU: both ways, each
    within rounding of torch's causal attention, and no allocator peak claimed without CUDA."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "cp_chunk_attention.py"
    spec = importlib.util.spec_from_file_location("cp_chunk_attention", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.measure(torch.device("cpu"), 8, 32, 4, 2, 8, torch.float32, 1)
    assert [r["way"] for r in rows] == ["lower-right causal bias (GPU)", "reversed additive view (CPU)"]
    assert all(r["max_abs_diff"] < 1e-5 and r["extra_peak_gib"] is None and r["median_s"] > 0 for r in rows)

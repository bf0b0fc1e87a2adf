"""The MoE router, the even split and the expert-load bookkeeping at exact values (issue 44's mutation scope,
docs/mutation.md). Expected values are worked out by hand in each test."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from harness.parallel.expert_load import ExpertLoad, moe_layers
from workloads.moe import LocalDispatch, MoE, Router, even_split
from workloads.sizes import MoESpec, get_size


@pytest.mark.parametrize("rows,parts,sizes", [
    (10, 4, [3, 3, 2, 2]),  # 10 = 4 x 2 + 2: the first two get one more
    (3, 5, [1, 1, 1, 0, 0]),  # fewer rows than parts
    (8, 4, [2, 2, 2, 2]),
    (0, 2, [0, 0]),
])
def test_even_split_by_hand(rows, parts, sizes):
    assert even_split(rows, parts) == sizes


def test_local_dispatch_keeps_the_rows_and_splits_them_by_the_counts_or_evenly():
    rows = torch.arange(10.0).unsqueeze(-1)
    counts = torch.tensor([4, 0, 5, 1])
    got, split, state = LocalDispatch().dispatch(rows, counts, False)
    assert got is rows and split == [4, 0, 5, 1] and state is None
    assert LocalDispatch().dispatch(rows, counts, True)[1] == [3, 3, 2, 2]  # 10 rows over 4 experts, by hand


def test_balanced_routing_by_hand_with_its_weights_in_the_inputs_dtype():
    """E = 3, k = 2, positions 0..3: slot j of position s -> expert (2 s + j) mod 3 = (0,1), (2,0), (1,2), (0,1).
    An identity router on x = one-hot rows: the weights are softmax probabilities of the chosen two, renormalised."""
    import math

    router = Router(3, MoESpec(n_experts=3, top_k=2, d_ff=4)).to(torch.float64)
    router.routing = "balanced"
    with torch.no_grad():
        router.score.weight.copy_(torch.eye(3, dtype=torch.float64))
    x = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.float64)
    choice, weights, probs, counts = router(x, torch.arange(4))
    assert choice.tolist() == [[0, 1], [2, 0], [1, 2], [0, 1]]
    assert counts.tolist() == [3, 3, 2]
    assert weights.dtype == torch.float64
    e = math.e
    # row 0: p = (e, 1, 1) / (e + 2); experts 0 and 1 -> e / (e + 1), 1 / (e + 1). Row 1: experts 2 and 0.
    torch.testing.assert_close(weights[0], torch.tensor([e / (e + 1), 1 / (e + 1)], dtype=torch.float64))
    torch.testing.assert_close(weights[1], torch.tensor([1 / (e + 1), e / (e + 1)], dtype=torch.float64))
    torch.testing.assert_close(weights[2], torch.tensor([0.5, 0.5], dtype=torch.float64))  # uniform p
    assert router.load.tolist() == [3.0, 3.0, 2.0]


def test_the_load_is_not_saved_and_the_bias_moves_only_under_bias_balancing():
    spec = MoESpec(n_experts=4, top_k=1, d_ff=4)
    router = Router(2, spec)
    assert set(router.state_dict()) == {"score.weight", "expert_bias"}  # load: a per-step count, not a weight
    assert router.routing == "learned"  # by the scores until ExpertLoad says otherwise
    load = torch.tensor([4.0, 0.0, 2.0, 2.0])  # mean 2
    router.update_bias(load)
    assert router.expert_bias.tolist() == pytest.approx([-spec.bias_rate, spec.bias_rate, 0.0, 0.0])
    aux = Router(2, replace(spec, balancing="aux"))
    aux.update_bias(load)
    assert aux.expert_bias.tolist() == [0.0] * 4 and aux.bias_rate == 0.0


class _CountingDispatch:
    """Stands for the expert-parallel dispatcher: (routed, left, received) rows per take, scripted."""

    def __init__(self, counts: list[tuple[int, int, int]]) -> None:
        self.counts = counts

    def take_counts(self) -> tuple[int, int, int]:
        return self.counts.pop(0)


def _two_layer_moe():
    size = get_size("tiny", "moe")
    size = replace(size, n_layers=2, seq_len=8, moe=replace(size.moe, n_experts=4))
    from workloads.model import Decoder

    torch.manual_seed(0)
    model = Decoder(size)
    return size, model


def test_expert_parallel_rows_per_step_halve_the_rerun_layers_and_list_them_apart():
    """Two layers, ``layer2``-style recompute reruns block 1 only (every 2nd): its counts are of two forwards, so
    halved. Step 1: layer 0 routed 10, sent 4, received 6; layer 1 counted 20, 8, 12 over its two forwards
    (10, 4, 6 each). By hand: routed 10 + 10, left 4 + 4, received 6 + 6; the rerun layer's routed 10, received 6."""
    size, model = _two_layer_moe()
    layers = moe_layers([model])
    assert [i for i, _ in layers] == [0, 1]
    layers[0][1].dispatcher = _CountingDispatch([(10, 4, 6), (1, 0, 1)])
    layers[1][1].dispatcher = _CountingDispatch([(20, 8, 12), (2, 2, 4)])
    load = ExpertLoad([model], size, "learned", "layer2", torch.device("cpu"))
    assert load.passes == {0: 1, 1: 2}
    assert load.ep_rows() == {"routed": [], "left": [], "received": [], "rerun_routed": [], "rerun_received": []}
    load.step()
    load.step()
    assert load.ep_rows() == {"routed": [20.0, 2.0], "left": [8.0, 1.0], "received": [12.0, 3.0],
                              "rerun_routed": [10.0, 1.0], "rerun_received": [6.0, 2.0]}


def test_without_expert_parallel_there_are_no_rows_to_report():
    size, model = _two_layer_moe()
    assert ExpertLoad([model], size, "learned", "none", torch.device("cpu")).ep_rows() is None


def test_the_load_summary_by_hand_over_the_measured_steps_only():
    """Loads set by hand (2 layers x 4 experts): a warmup step, then two measured. Per layer-step, busiest over
    that layer-step's mean: step 1 (8,0,0,0) 8/2 = 4 and (3,3,3,3) 3/3 = 1; step 2 (4,4,0,0) 4/2 = 2 and (1,5,2,4)
    5/3. Mean (4 + 1 + 2 + 5/3) / 4, worst 4; tokens per expert the mean of the two steps."""
    size, model = _two_layer_moe()
    load = ExpertLoad([model], size, "learned", "none", torch.device("cpu"), tp=2)
    routers = [layer.router for _, layer in moe_layers([model])]
    steps = [([9.0, 9, 9, 9], [9.0, 9, 9, 9]),  # warmup, not summarised
             ([8.0, 0, 0, 0], [3.0, 3, 3, 3]),
             ([4.0, 4, 0, 0], [1.0, 5, 2, 4])]
    for i, per_layer in enumerate(steps):
        for router, counts in zip(routers, per_layer, strict=True):
            router.load.copy_(2 * torch.tensor(counts))  # tp 2: both tp ranks counted the same tokens
        load.step()
        if i == 0:
            load.window_start()
    assert load.first == 1
    assert load.summary() == {"tokens_per_expert": [[6.0, 2.0, 0.0, 0.0], [2.0, 4.0, 2.5, 3.5]],
                              "imbalance_max_over_mean": pytest.approx((4 + 1 + 2 + 5 / 3) / 4),
                              "imbalance_max_over_mean_worst": 4.0}
    assert load.per_step()[1] == [[8.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]]


def test_moe_layers_name_their_block_and_refuse_a_layer_outside_one():
    size, model = _two_layer_moe()
    assert [(i, type(m)) for i, m in moe_layers([model, nn.Linear(2, 2)])] == [(0, MoE), (1, MoE)]
    stray = nn.ModuleDict({"mlp": MoE(8, MoESpec(n_experts=2, top_k=1, d_ff=4))})
    with pytest.raises(AssertionError, match=r"MoE layer 'mlp' is not inside a block"):
        moe_layers([stray])


def test_balanced_routing_without_positions_is_refused_by_name():
    router = Router(2, MoESpec(n_experts=2, top_k=1, d_ff=4))
    router.routing = "balanced"
    with pytest.raises(AssertionError, match=r"^balanced routing needs the tokens' positions$"):
        router(torch.zeros(3, 2), None)


def test_an_moe_layer_on_the_meta_device_routes_and_back_propagates_there():
    """Shapes only (``harness fit`` runs without values, the even split standing for the counts): every tensor the
    layer makes, the round robin's slots and the auxiliary loss's seed gradient, is made on the input's device."""
    layer = MoE(4, MoESpec(n_experts=4, top_k=2, d_ff=8, balancing="aux")).to("meta")
    layer.even_split = True
    layer.router.routing = "balanced"
    x = torch.empty(2, 3, 4, device="meta", requires_grad=True)
    out = layer(x)
    assert out.device.type == "meta" and out.shape == (2, 3, 4)
    out.sum().backward()
    assert layer.router.score.weight.grad.device.type == "meta"


class _Spy(LocalDispatch):
    """A local dispatcher that records what the layer hands it and hands its state back to combine."""

    def __init__(self) -> None:
        self.even: list[bool] = []
        self.states: list[object] = []

    def dispatch(self, grouped, counts, even):
        self.even.append(even)
        rows, split, _ = super().dispatch(grouped, counts, even)
        return rows, split, ("state", len(self.even))

    def combine(self, y, state):
        self.states.append(state)
        return y


def test_the_layer_hands_its_dispatcher_the_even_flag_and_combine_the_dispatchs_state():
    layer = MoE(4, MoESpec(n_experts=2, top_k=1, d_ff=8))
    spy = _Spy()
    layer.dispatcher = spy
    layer(torch.randn(1, 4, 4))
    layer.even_split = True
    layer(torch.randn(1, 4, 4))
    assert spy.even == [False, True]
    assert spy.states == [("state", 1), ("state", 2)]


def test_balanced_routing_under_context_parallel_follows_the_global_positions():
    """Rank 1 of cp 2 holds positions 2, 3 (chunk 1) and 4, 5 (chunk 2) of 8 (head-tail, by hand). E = 8, k = 1:
    token at s -> expert s mod 8, so experts 2, 3, 4, 5 get one token each (local positions 0..3 would give 0..3)."""
    from harness.parallel.cp import SequenceShard

    layer = MoE(4, MoESpec(n_experts=8, top_k=1, d_ff=8))
    layer.router.routing = "balanced"
    layer.seq_shard = SequenceShard(rank=1, size=2)
    layer(torch.randn(1, 4, 4))
    assert layer.router.take_load().tolist() == [0, 0, 1, 1, 1, 1, 0, 0]


def test_expert_load_sets_each_routers_routing():
    size, model = _two_layer_moe()
    ExpertLoad([model], size, "balanced", "none", torch.device("cpu"))
    assert [layer.router.routing for _, layer in moe_layers([model])] == ["balanced", "balanced"]


def test_a_layer_that_is_the_block_itself_is_found_and_no_steps_are_no_samples():
    blocks = nn.ModuleDict({"blocks": nn.ModuleDict({"3": MoE(4, MoESpec(n_experts=2, top_k=1, d_ff=4))})})
    assert [i for i, _ in moe_layers([blocks])] == [3]  # the name ends at the block index ("blocks.3")
    size, model = _two_layer_moe()
    assert ExpertLoad([model], size, "learned", "none", torch.device("cpu")).per_step() == []


def test_the_load_is_kept_on_the_runs_device():
    """On the meta device (no values): each step's load is made where the routers count, not on the CPU."""
    size, model = _two_layer_moe()
    model.to("meta")
    load = ExpertLoad([model], size, "learned", "none", torch.device("meta"))
    load.step()
    assert load.steps[0].device.type == "meta" and load.steps[0].shape == (2, 4)

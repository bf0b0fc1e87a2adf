"""The moe family: exact total and active counts, active FLOPs against FlopCounterMode, and the layer's routing."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from harness.cli import main
from harness.model.activations import moe_token_bytes
from harness.model.inventory import param_specs
from harness.model.shape import CellShape
from harness.parallel.expert_load import ExpertLoad
from harness.parallel.presets import degrees_for
from harness.planner import expand
from harness.run.parity import parity_diffs, routing_divergence
from harness.spec import SweepSpec
from tests.unit.test_workloads import counted_flops_per_token
from workloads.model import Decoder
from workloads.moe import MoE
from workloads.sizes import MoESpec, get_size

# The released checkpoints' parameter counts (every tensor of Mixtral-8x7B-v0.1 and Qwen3-30B-A3B,
# untied heads both) and their "active" counts: 12.9B and 3.3B as the model cards round them.
PUBLISHED = {"mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624}


@pytest.mark.parametrize("name", ["tiny", "mini", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_param_count_formula_matches_model(name):
    size = get_size(name, "moe")
    with torch.device("meta"):
        model = Decoder(size)
    assert sum(p.numel() for p in model.parameters()) == size.params
    if name in PUBLISHED:
        assert size.params == PUBLISHED[name]


def test_active_counts_by_hand():
    """Active: attention, norms, the router over all E experts, k routed experts (3 d f each), embeddings and head."""
    mix = get_size("mixtral-8x7b", "moe")
    attn = 2 * 4096 * 4096 + 2 * 4096 * 1024
    per_layer = attn + 2 * 4096 + 4096 * 8 + 2 * 3 * 4096 * 14_336
    assert mix.params_active == 32 * per_layer + 2 * 32_000 * 4096 + 4096 == 12_879_925_248
    qwen = get_size("qwen3-30b-a3b", "moe")
    assert qwen.q_dim == 4096 and qwen.head_dim == 128
    assert round(qwen.params_active / 1e9, 1) == 3.4 and round(qwen.params_active_nonembedding / 1e9, 2) == 3.04
    assert round(mix.params_active / 1e9, 1) == 12.9


@pytest.mark.parametrize("name,seq", [("tiny", 128), ("mini", 256)])
def test_active_flops_match_flop_counter(name, seq):
    """6 N_active + 12 L q S within 2% of the counted fwd+bwd FLOPs; total-parameter FLOPs are off by
    the idle experts' 6 L (E - k) 3 d f, 2.2-2.6x at these sizes."""
    size = replace(get_size(name, "moe"), seq_len=seq)
    counted = counted_flops_per_token(size)
    assert counted == pytest.approx(size.flops_per_token(), rel=0.02)
    idle = 6 * size.n_layers * (size.moe.n_experts - size.moe.top_k) * 3 * size.d_model * size.moe.d_ff
    assert size.flops_per_token_total() - size.flops_per_token() == idle
    assert size.flops_per_token_total() / counted > 2


def _layer(spec: MoESpec, d: int = 16, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(d, spec)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _by_hand(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through its k experts one by one, weighted by its renormalised top-k scores."""
    flat = x.reshape(-1, x.shape[-1])
    probs = (flat @ layer.router.score.weight.T).softmax(-1)
    top = (probs + layer.router.expert_bias).topk(layer.spec.top_k, dim=-1).indices
    ex = layer.experts
    out = torch.zeros_like(flat)
    for i, row in enumerate(flat):
        w = probs[i, top[i]] / probs[i, top[i]].sum()
        for j, e in enumerate(top[i].tolist()):
            out[i] += w[j] * ((F.silu(row @ ex.gate[e].T) * (row @ ex.up[e].T)) @ ex.proj[e].T)
    if layer.shared is not None:
        out = out + layer.shared(flat)
    return out.view_as(x)


@pytest.mark.parametrize("shared", [0, 1])
def test_layer_is_every_token_through_its_top_k_experts(shared):
    """Dropless: the grouped dispatch equals the token-by-token sum, whatever the load."""
    layer = _layer(MoESpec(4, 2, 8, n_shared=shared))
    x = torch.randn(2, 6, 16)
    assert torch.allclose(layer(x), _by_hand(layer, x), atol=1e-5)
    assert layer.router.load.sum().item() == 2 * 6 * 2  # each token counted at k experts


def test_balanced_routing_is_a_round_robin_over_positions():
    """Token at position s, slot j -> expert (s k + j) mod E: equal load when S k is a multiple of E,
    the same for every sequence of the batch, whatever the scores."""
    layer = _layer(MoESpec(8, 2, 8))
    layer.router.routing = "balanced"
    layer(torch.randn(3, 12, 16))
    assert layer.router.take_load().tolist() == [9.0] * 8  # 3 x 12 x 2 / 8
    assert layer.router.load.sum().item() == 0  # take_load restarts the count


def test_bias_steers_the_choice_and_moves_towards_the_mean_load():
    layer = _layer(MoESpec(4, 1, 8))
    layer.router.expert_bias[2] = 10.0  # far above any softmax score: every token picks expert 2
    x = torch.randn(1, 10, 16)
    assert torch.allclose(layer(x), _by_hand(layer, x), atol=1e-5)
    load = layer.router.take_load()
    assert load.tolist() == [0.0, 0.0, 10.0, 0.0]
    layer.router.update_bias(load)
    rate = MoESpec(4, 1, 8).bias_rate
    assert layer.router.expert_bias.tolist() == pytest.approx([rate, rate, 10.0 - rate, rate])


def test_aux_loss_trains_the_router_without_changing_the_output():
    """Under ``aux`` the output (so the reported loss) is the same, and the router's gradient is that of
    loss + coef E sum f_e P_e; under ``bias`` (and ``aux`` at eval) there is no such term."""
    spec = MoESpec(4, 2, 8, balancing="aux", aux_coef=0.5)
    x = torch.randn(2, 5, 16)
    with_aux, plain = _layer(spec), _layer(replace(spec, balancing="bias"))
    out = with_aux(x)
    assert torch.equal(out, plain(x))
    out.square().sum().backward()
    plain(x).square().sum().backward()
    ref = _layer(replace(spec, balancing="bias"))
    flat = x.reshape(-1, 16)
    probs = (flat @ ref.router.score.weight.T).softmax(-1)
    share = torch.bincount(probs.topk(2, dim=-1).indices.flatten(), minlength=4).float() / (10 * 2)
    aux = 0.5 * 4 * (share * probs.mean(0)).sum()
    (ref(x).square().sum() + aux).backward()
    assert torch.allclose(with_aux.router.score.weight.grad, ref.router.score.weight.grad, atol=1e-6)
    assert not torch.allclose(plain.router.score.weight.grad, ref.router.score.weight.grad, atol=1e-6)


@pytest.mark.parametrize("shared", [0, 1])
def test_what_an_moe_layer_saves_for_backward_is_the_models(shared):
    """The bytes an MoE layer's forward saves for its backward (autograd's saved tensors, each storage once,
    without its input and parameters) against ``moe_token_bytes`` per token: equal but for the routing's
    integer indices (under 1%). Three rows of d per slot: the grouped copy, the expert's output and the
    weighted output, which ``index_add`` keeps as its source (the model counted two, 15% less on tiny)."""
    size = get_size("tiny", "moe")
    size = replace(size, moe=replace(size.moe, n_shared=shared))
    torch.manual_seed(0)
    layer = MoE(size.d_model, size.moe)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(2, 128, size.d_model, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    measured = sum(n for ptr, n in saved.items() if ptr not in skip) / (2 * 128)
    shape = CellShape(size=size, dims=degrees_for("single", 1), strategy="single", precision="fp32", global_batch=2)
    assert measured == pytest.approx(moe_token_bytes(shape), rel=0.01)


def test_moe_spec_refuses_what_cannot_route():
    with pytest.raises(ValueError, match=r"top_k \(3\) must be in 1..n_experts \(2\)"):
        MoESpec(2, 3, 8)
    with pytest.raises(ValueError, match="balancing 'none': choose from bias, aux"):
        MoESpec(8, 2, 8, balancing="none")


@pytest.mark.parametrize("name", ["tiny", "mini", "qwen3-30b-a3b"])
def test_inventory_is_the_models_tensors_in_order(name):
    """The performance model's inventory (what memory and comm count) names every tensor the model
    registers, with its shape: the router, the stacked experts, the shared expert, Qwen3's q/k norms."""
    size = get_size(name, "moe")
    with torch.device("meta"):
        model = Decoder(size)
    assert [(q.name, q.shape) for q in param_specs(size)] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def test_workloads_lists_total_and_active_counts(capsys):
    """``harness workloads --arch moe``: total and active parameters side by side, FLOPs on the active ones."""
    assert main(["workloads", "--arch", "moe"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| mixtral-8x7b"))
    assert "46,702,792,704" in row and "12,879,925,248" in row
    assert "| params active " in out and "MFLOP/token palm (active)" in out and "wrong for MFU" in out


def test_routing_axis_ids_and_refusals(tmp_path, capsys):
    """``--moe-routing learned,balanced`` crosses the moe cells only (a dense family has nothing to route);
    a balanced cell says so in its id; asked of a dense family alone, it is refused before anything runs."""
    spec = SweepSpec(sizes=("tiny",), strategies=("fsdp",), precisions=("fp32",), gpus=(2,), device_kind="cpu",
                     batch=4, steps=2, warmup=1, archs=("llama3", "moe"), moe_routings=("learned", "balanced"))
    ids = [c.cell_id for c in expand(spec)]
    assert "moe-tiny-fsdp-fp32-w2-gb4-strong-route-balanced" in ids and "moe-tiny-fsdp-fp32-w2-gb4-strong" in ids
    assert not any(i.startswith("llama3-") and "route" in i for i in ids)
    assert main(["plan", "--arch", "gpt2", "--moe-routing", "balanced", "--sizes", "tiny", "--gpus", "2"]) == 2
    assert "--moe-routing balanced: only a mixture of experts routes tokens" in capsys.readouterr().err
    assert main(["plan", "--arch", "moe", "--sizes", "tiny", "--gpus", "2", "--strategies", "tp"]) == 0
    tp_row = next(line for line in capsys.readouterr().out.splitlines() if "moe-tiny-tp-" in line)
    assert "invalid" in tp_row and "tp (2) on a mixture of experts needs expert parallel" in tp_row


class _Recorder:
    """Stands in for harness.measure.nvtx_ranges.Ranges: records the ranges entered."""

    def __init__(self) -> None:
        self.entered: list[str] = []

    def range(self, name: str):
        self.entered.append(name)
        return contextlib.nullcontext()


@pytest.mark.parametrize("ac,passes", [("none", 1), ("full", 2)])
def test_expert_load_steps_the_bias_records_the_load_and_opens_the_ranges(ac, passes):
    """One process: each step takes every router's count (halved when full recompute routes each micro-batch
    twice), moves the biases against it, and keeps it; every layer's forward opens dispatch, experts,
    combine in turn."""
    size = replace(get_size("tiny", "moe"), seq_len=16)
    torch.manual_seed(0)
    model = Decoder(size)
    rec = _Recorder()
    load = ExpertLoad([model], size, "learned", ac, torch.device("cpu"), rec)
    x = torch.randint(0, size.vocab_size, (2, 16))
    for _ in range(passes):
        model(x)
    assert rec.entered == ["dispatch", "experts", "combine"] * size.n_layers * passes
    load.step()
    summary = load.summary()
    assert [sum(layer) for layer in summary["tokens_per_expert"]] == [2 * 16 * 2] * size.n_layers
    router = model.blocks["0"].mlp.router
    taken = torch.tensor(summary["tokens_per_expert"][0])
    assert torch.equal(router.expert_bias, 1e-3 * torch.sign(taken.mean() - taken))
    assert summary["imbalance_max_over_mean"] == pytest.approx(
        sum(max(row) / (sum(row) / len(row)) for row in summary["tokens_per_expert"]) / size.n_layers)
    assert load.per_step() == [summary["tokens_per_expert"]]
    load.window_start()  # the measured window starts after the steps so far
    assert load.summary() == {}


def test_a_rounding_flip_of_the_router_limits_the_loss_compared_and_a_real_divergence_does_not():
    """Parity against one device: a step whose expert load moved by one slot (a near-tie of the top-k that
    rounding decided otherwise) ends the loss curve compared; a step that moved more is a real difference,
    and the whole curve is held to the tolerance."""
    ref_loads = [[[4.0, 4.0]], [[5.0, 3.0]], [[6.0, 2.0]]]
    ref = {"cell_id": "ref", "metrics": {"loss": [3.0, 2.0, 1.0], "grad_norm_step1": 1.0},
           "samples": {"moe_load_per_step": ref_loads}}
    flipped = [[[4.0, 4.0]], [[4.0, 4.0]], [[6.0, 2.0]]]  # step 1: one slot moved
    worker = {"loss": [3.0, 2.0001, 1.5], "grad_norm_step1": 1.0}
    assert routing_divergence({"moe_load_per_step": flipped}, ref["samples"]) == \
        {"step": 1, "slots_moved": 1.0, "max_slots_moved_per_layer": 1.0}
    assert parity_diffs(worker, {"moe_load_per_step": flipped}, ref)["loss"] == 0.0  # step 0 only
    moved = [[[4.0, 4.0]], [[1.0, 7.0]], [[6.0, 2.0]]]  # step 1: four slots moved in one layer
    assert parity_diffs(worker, {"moe_load_per_step": moved}, ref)["loss"] == pytest.approx(0.5)
    assert routing_divergence({"moe_load_per_step": ref_loads}, ref["samples"]) is None


def test_the_routers_choice_and_combine_weights_by_hand_with_top2_and_a_balancing_bias():
    """E = 4, k = 2, scores = x (an identity router), x = (2, 1, 0, 0), expert bias (0, 0, 3, 0). By hand: the
    probabilities are softmax(2, 1, 0, 0) = (e^2, e, 1, 1) / (e^2 + e + 2); the bias picks by p + b, so expert 2
    (p_2 + 3) then expert 0 (the likeliest); the combine weights are the unbiased p of the two, renormalised:
    1 / (1 + e^2) for expert 2 and e^2 / (1 + e^2) for expert 0 (DeepSeek-V3: the bias chooses, it never weighs)."""
    import math

    from workloads.moe import Router

    router = Router(4, MoESpec(n_experts=4, top_k=2, d_ff=8))
    with torch.no_grad():
        router.score.weight.copy_(torch.eye(4))
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 3.0, 0.0]))
    choice, weights, probs, counts = router(torch.tensor([[2.0, 1.0, 0.0, 0.0]]), None)
    e2 = math.e ** 2
    z = e2 + math.e + 2
    torch.testing.assert_close(probs, torch.tensor([[e2 / z, math.e / z, 1 / z, 1 / z]]))
    assert choice.tolist() == [[2, 0]]
    torch.testing.assert_close(weights, torch.tensor([[1 / (1 + e2), e2 / (1 + e2)]]))
    assert counts.tolist() == [1, 0, 1, 0]
    router.expert_bias.zero_()  # without the bias: the two likeliest, expert 0 then 1, weighted e^2 : e
    choice, weights, _, _ = router(torch.tensor([[2.0, 1.0, 0.0, 0.0]]), None)
    assert choice.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[e2 / (e2 + math.e), math.e / (e2 + math.e)]]))


def test_each_routing_is_held_to_its_own_single_device_reference_also_after_a_resume():
    """A sweep with --moe-routing learned,balanced has two single-device references. A resume re-reads the finished
    records in file order, both singles among them: each routing's cells must still find their own (before the fix
    the parity key had no routing, so the last single read was every cell's reference)."""
    from harness.run.parity import parity_key
    from harness.run.sweep import _keep_reference

    base = dict(arch="moe", size="tiny", precision="fp32", global_batch=8, seq_len=64, lr=1e-3, lr_warmup_steps=0,
                seed=0, steps=5, warmup=1, scaling="strong", lr_rule="none")
    singles = [{"cell_id": f"moe-tiny-single-{r}", "status": "ok", "config": {**base, "strategy": "single", "moe_routing": r}}
               for r in ("learned", "balanced")]
    references: dict = {}
    for rec in singles:  # as a resume reads them: learned first, then balanced
        _keep_reference(references, rec)
    for routing in ("learned", "balanced"):
        ep_cell = {**base, "strategy": "ep", "moe_routing": routing}
        assert references[parity_key(ep_cell)]["cell_id"] == f"moe-tiny-single-{routing}"

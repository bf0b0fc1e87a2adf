"""The compute model's recomputation (:func:`harness.model.compute.recompute_factor`) at every checkpointing policy
of every family, held to the matmul FLOPs a real step runs, counted by ``torch.utils.flop_counter.FlopCounterMode``
(the policy's step less the same step without checkpointing: what the backward ran again), torch's checkpoint
early stop on as a cell runs it. Issue 61: a term held at every setting of the axes it branches on (policy x
family; the tensor-parallel and expert-parallel splits are the same ``block_matmuls`` list, held in
tests/unit/test_ac_policies.py); and the wrapper overhead at every strategy's branch."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from harness.model.compute import ComputeRates, early_stopped_flops, rates_from_entry, recompute_factor, wrapper_of
from harness.model.shape import CellShape
from harness.parallel.activation_checkpoint import apply_ac, checkpointed_layer
from harness.parallel.presets import degrees_for
from workloads.model import Decoder, lm_loss
from workloads.sizes import get_size

SEQ, BATCH = 32, 2


def _size(arch: str):
    """The family's tiny size without biases: the model counts 2 FLOPs per bias too (6N), ``FlopCounterMode`` the
    matmul of an ``addmm`` only; without them the two conventions are one."""
    return replace(get_size("tiny", arch), seq_len=SEQ, bias=False)
MATMUL_OPS = (torch.ops.aten.mm, torch.ops.aten.addmm)
"""The linears' FLOPs (attention is its own kernel on CPU, priced apart: the model's causal convention)."""


@cache
def _matmul_flops(arch: str, policy: str) -> int:
    torch.manual_seed(0)
    size = _size(arch)
    model = Decoder(size)
    for _, block in model.block_items():
        router = getattr(getattr(block, "mlp", None), "router", None)
        if router is not None:
            router.routing = "balanced"  # every expert its share of the rows, as the model prices them
    apply_ac(model, policy)
    x = torch.randint(0, size.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(x), x).backward()
    counts = counter.get_flop_counts()["Global"]
    return sum(int(counts.get(op, 0)) for op in MATMUL_OPS)


def _model_matmul_recompute(arch: str, policy: str) -> float:
    """The model's recomputed FLOPs of the step less its attention's (2 x width x seq per token per layer run
    again: ``full``, ``layerN``'s and ``attn``'s)."""
    size = _size(arch)
    c = CellShape(size=size, dims=degrees_for("single", 1), strategy="single", precision="fp32",
                  global_batch=BATCH, recompute=policy)
    again = sum(1 for i in range(size.n_layers) if checkpointed_layer(policy, i) or policy == "attn")
    attention = again * 2 * size.attention_width * size.seq_len
    return ((recompute_factor(c) - 1) * size.flops_per_token() - attention) * BATCH * SEQ


@pytest.mark.parametrize("arch", ["gpt2", "llama3", "moe"])
@pytest.mark.parametrize("policy", ["full", "layer2", "op", "attn"])
def test_recomputed_matmul_flops_are_the_steps(arch, policy):
    measured = _matmul_flops(arch, policy) - _matmul_flops(arch, "none")
    assert measured == pytest.approx(_model_matmul_recompute(arch, policy), rel=1e-9), (arch, policy)


def test_early_stop_skips_a_dense_blocks_mlp_output_only():
    """By hand: gpt2 tiny's MLP output projection is 512 x 128 (2 FLOPs per weight); llama3 tiny's its SwiGLU
    down projection; an MoE block none."""
    gpt2, llama3, moe = (get_size("tiny", a) for a in ("gpt2", "llama3", "moe"))
    assert early_stopped_flops(gpt2, 0) == 2 * gpt2.d_ff * gpt2.d_model == 2 * 512 * 128
    assert early_stopped_flops(llama3, 0) == 2 * llama3.d_ff * llama3.d_model
    assert early_stopped_flops(moe, 0) == 0.0


# ---- the wrapper overhead term at every strategy branch (issue 61: "a strategy's branch never asserted") ----

@pytest.mark.parametrize(("strategy", "world", "sp", "wrapper"), [
    ("single", 1, True, None), ("ddp", 2, True, None), ("pp", 2, True, None), ("fsdp", 2, True, "fsdp"),
    ("tp", 2, True, "tp"), ("tp-sp", 2, True, "tp-sp"), ("fsdp+tp", 4, True, "fsdp+tp"), ("fsdp+tp", 4, False, "fsdp+tp"),
    ("hsdp", 4, True, "fsdp")])
def test_each_strategy_pays_its_wrappers_calibrated_overhead(strategy, world, sp, wrapper):
    c = CellShape(size=_size("gpt2"), dims=degrees_for(strategy, world, sequence_parallel=sp), strategy=strategy,
                  precision="fp32", global_batch=8)
    assert wrapper_of(c) == wrapper


def test_a_workload_entry_gives_its_wrappers_costs_and_none_for_another():
    entry = {"alpha_s": 0.5, "beta_s_per_row": 0.25, "optimizer_s_per_param": 1e-9, "base_gib": 0.75,
             "wrapper_overhead_s": {"fsdp": 0.125, "tp": 0.0625}, "wrapper_optimizer_s": {"fsdp": 0.03125}}
    fsdp = rates_from_entry(entry, "fsdp")
    assert fsdp == ComputeRates(alpha_s=0.5, beta_s_per_row=0.25, optimizer_s_per_param=1e-9, basis="workload",
                                base_gib=0.75, wrapper_overhead_s=0.125, wrapper_optimizer_s=0.03125)
    assert (rates_from_entry(entry, "tp").wrapper_overhead_s, rates_from_entry(entry, "tp").wrapper_optimizer_s) == \
        (0.0625, 0.0)
    assert (rates_from_entry(entry, None).wrapper_overhead_s, rates_from_entry(entry, "tp-sp").wrapper_overhead_s) == \
        (0.0, 0.0)
    bare = rates_from_entry({"alpha_s": 1.0, "beta_s_per_row": 2.0, "optimizer_s_per_param": 3.0}, "fsdp")
    assert (bare.base_gib, bare.wrapper_overhead_s, bare.wrapper_optimizer_s) == (None, 0.0, 0.0)

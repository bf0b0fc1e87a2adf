"""Activation checkpointing policies: what each keeps of a real block (live tensor storages, every storage once)
against the memory model, and what each recomputes against FLOPs written out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.errors import UsageError
from harness.measure.tensor_bytes import TensorBytes
from harness.model.activations import kept_token_bytes, op_token_bytes, rope_table_bytes
from harness.model.compute import recompute_factor
from harness.model.shape import CellShape
from harness.parallel.activation_checkpoint import (
    AC_POLICIES,
    EveryOtherMatmul,
    ac_policy,
    apply_ac,
    checkpointed_layer,
    policies_arg,
    reruns_forward,
)
from harness.parallel.presets import degrees_for
from workloads.model import Decoder
from workloads.sizes import get_size

ROWS, SEQ, LAYERS = 2, 64, 3


def _shape(arch: str, policy: str) -> CellShape:
    size = replace(get_size("tiny", arch), seq_len=SEQ, n_layers=LAYERS)
    return CellShape(size=size, dims=degrees_for("single", 1), strategy="single", precision="fp32",
                     global_batch=ROWS, recompute=policy)


def _kept_by_blocks(arch: str, policy: str) -> int:
    """Bytes the blocks of a real 3-layer model keep after their forward (TensorBytes: each storage once, its
    parameters and input held before), the last block's output left out."""
    c = _shape(arch, policy)
    torch.manual_seed(0)
    model = Decoder(c.size)
    apply_ac(model, policy)
    x = torch.randn(ROWS, SEQ, c.size.d_model, requires_grad=True)
    with TensorBytes() as tb:
        tb.hold([*model.parameters(), *model.buffers(), x])
        before = tb.live_bytes
        h = x
        for block in model.blocks.values():
            h = block(h)
        return tb.live_bytes - h.untyped_storage().nbytes() - before


@pytest.mark.parametrize("arch", ["gpt2", "llama3", "moe"])
@pytest.mark.parametrize("policy", ["none", "attn", "op", "layer2", "full"])
def test_what_each_policy_keeps_is_the_models(arch, policy):
    """The model per layer (:func:`kept_token_bytes`, which counts each block's input) and RoPE's tables, less the
    first block's input (held here), against the live bytes. ``op`` and ``full`` keep exactly what the model
    counts; the others within 0.6%: the norms' statistics and SDPA's log-sum-exp (a float or two per token and
    head) are not counted."""
    c = _shape(arch, policy)
    tokens = ROWS * SEQ
    model = sum(kept_token_bytes(c, i) for i in range(LAYERS)) * tokens + sum(rope_table_bytes(c, i)
                                                                             for i in range(LAYERS))
    model -= c.size.d_model * 4 * tokens  # the first block's input, held before the forward
    measured = _kept_by_blocks(arch, policy)
    if policy in ("op", "full") and arch != "moe":
        assert measured == model
    else:  # an MoE's op: the experts' rows split by the router, the model assumes them balanced
        assert measured == pytest.approx(model, rel=0.006)


def test_op_keeps_q_v_gate_and_the_mlp_output_of_a_llama3_block():
    """By hand, llama3 tiny (d 128, 4 heads of 32, 2 kv heads, SwiGLU 352), fp32 per token: matmuls q k v out
    gate up proj, the 1st, 3rd, 5th, 7th kept: q 128 + v 64 + gate 352 + proj 128 = 672 floats; SDPA's output
    128 floats and log-sum-exp 4 (a head each); the block's input 128: 932 floats = 3,728 bytes."""
    assert op_token_bytes(_shape("llama3", "op")) == 3728


def test_layer_n_checkpoints_every_n_th_block_counted_from_one():
    assert [checkpointed_layer("layer2", i) for i in range(6)] == [False, True, False, True, False, True]
    assert [checkpointed_layer("layer3", i) for i in range(6)] == [False, False, True, False, False, True]
    assert all(checkpointed_layer("full", i) for i in range(4))
    assert not any(checkpointed_layer(p, i) for p in ("none", "attn", "op") for i in range(4))
    assert [reruns_forward("op", i) for i in range(2)] == [True, True]
    assert [reruns_forward("attn", i) for i in range(2)] == [False, False]  # the attention core only


def test_policy_names_and_refusals():
    assert ac_policy("selective") == "attn"  # records from before op keep reading
    assert policies_arg("--ac", "none,layer4,full") == ("none", "layer4", "full")
    for bad in ("layer1", "layer", "layer02", "some"):
        with pytest.raises(UsageError, match=f"--ac: unknown activation checkpointing '{bad}'"):
            policies_arg("--ac", bad)
    assert set(AC_POLICIES) == {"none", "attn", "op", "layer2", "full"}


def test_every_other_matmul_counts_forward_and_recompute_apart():
    class Ctx:
        def __init__(self, again: bool) -> None:
            self.is_recompute = again

    mm, sdpa, add = (torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                     torch.ops.aten.add.Tensor)
    policy = EveryOtherMatmul()
    kept = [policy(Ctx(False), op).name for op in (mm, mm, add, sdpa, mm)]
    assert kept == ["MUST_SAVE", "PREFER_RECOMPUTE", "PREFER_RECOMPUTE", "MUST_SAVE", "MUST_SAVE"]
    assert policy(Ctx(True), mm).name == "MUST_SAVE"  # the recompute's first matmul: its own count


def test_mixtral_full_recompute_runs_the_active_experts_again():
    """Mixtral-8x7B (32 layers, d 4096, 32 query and 8 kv heads of 128, 8 experts of 14,336, top 2, vocab 32,000),
    seq 4096, by hand. A layer's weights a token computes with: attention 4096 x (4096 + 2 x 1024 + 4096) =
    41,943,040, router 4096 x 8 = 32,768, two experts 2 x 3 x 4096 x 14,336 = 352,321,536; norms 2 x 4096.
    Model FLOPs per token: 6 N + 12 L q S with N = 32 x (41,943,040 + 32,768 + 352,321,536 + 8,192) + 4096
    (final norm) + 4096 x 32,000 (head). Full recompute adds every layer's forward: 2 x its matmul weights and
    the attention's 4 d S. Counting all 8 experts, as the model once did, gives 2.15."""
    layer = 41_943_040 + 32_768 + 352_321_536
    n_active = 32 * (layer + 8_192) + 4_096 + 4_096 * 32_000
    model = 6 * n_active + 12 * 32 * 4096 * 4096
    extra = 32 * (2 * layer + 4 * 4096 * 4096)
    c = CellShape(size=get_size("mixtral-8x7b", "moe"), dims=degrees_for("single", 1), strategy="single",
                  precision="bf16", global_batch=1, recompute="full")
    assert c.size.flops_per_token() == model
    assert recompute_factor(c) == pytest.approx(1 + extra / model, rel=1e-12)
    assert recompute_factor(c) == pytest.approx(1.33, abs=0.005)
    assert recompute_factor(replace(c, recompute="layer2")) == pytest.approx(1 + extra / model / 2, rel=1e-12)


def test_op_recomputes_k_the_output_projection_and_up_of_llama3_8b():
    """Llama-3-8B (d 4096, q 4096, kv 1024, SwiGLU 14,336, 32 layers), by hand: op recomputes the 2nd, 4th and
    6th matmul of each block, k (4096 x 1024), the output projection (4096 x 4096) and up (4096 x 14,336), 2
    FLOPs per weight; the attention is kept."""
    c = CellShape(size=get_size("8b", "llama3"), dims=degrees_for("single", 1), strategy="single",
                  precision="bf16", global_batch=1, recompute="op")
    extra = 32 * 2 * (4096 * 1024 + 4096 * 4096 + 4096 * 14_336)
    assert recompute_factor(c) == pytest.approx(1 + extra / c.size.flops_per_token(), rel=1e-12)

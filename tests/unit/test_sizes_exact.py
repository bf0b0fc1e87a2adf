"""Exact values for what the sizes table grew since its mutation score was 100%: the MoE layer's active parameters,
its top-k bounds, every FLOPs convention at a sequence length other than the size's, and the record's workload
fields of each family.

Expected values are worked by hand from the sizes' published shapes (the arithmetic in the comments), not read back
from ``workloads.sizes``.
"""

from __future__ import annotations

import pytest

from workloads.sizes import MoESpec, get_size


def test_an_moe_layers_active_parameters_by_hand():
    # router d x E, then top_k routed experts and the shared ones, each a SwiGLU of 3 x d x d_ff
    spec = MoESpec(n_experts=8, top_k=2, d_ff=128, n_shared=1)
    assert spec.active_params(128) == 128 * 8 + (2 + 1) * 3 * 128 * 128  # 1,024 + 147,456
    assert spec.params(128) == 128 * 8 + (8 + 1) * 3 * 128 * 128


def test_top_k_may_be_every_expert_but_not_more_or_none():
    assert MoESpec(n_experts=8, top_k=8, d_ff=16).top_k == 8
    for k in (0, 9):
        with pytest.raises(ValueError, match=rf"^top_k \({k}\) must be in 1..n_experts \(8\)$"):
            MoESpec(n_experts=8, top_k=k, d_ff=16)


def test_every_flops_convention_takes_the_sequence_length_asked():
    """moe tiny by hand: 4 layers, d 128 (4 heads of 32), 8 experts of SwiGLU d_ff 128, top-2. Non-embedding
    parameters 1,807,488, of which 4 x 6 idle experts x 3 x 128 x 128 = 1,179,648 are inactive: 627,840 active."""
    size = get_size("tiny", "moe")
    active, total, attn = 627_840, 1_807_488, 4 * 128 * 64  # L x d x S at S = 64 (the size's is 128)
    assert size.flops_per_token(64) == 6 * active + 12 * attn
    assert size.flops_per_token_megatron(64) == 6 * active + 6 * attn
    assert size.flops_per_token_torchtitan(64) == 6 * active + 12 * 4 * 4 * 32 * 64  # L x H x head_dim x S
    assert size.flops_per_token_total(64) == 6 * total + 12 * attn
    assert size.flops_by_convention(64) == {"palm": 6 * active + 12 * attn, "megatron": 6 * active + 6 * attn,
                                            "torchtitan": 6 * active + 12 * attn}


def test_a_records_workload_fields_per_family():
    """gpt2 keeps the fields it always had; llama3 adds its shape and torchtitan's count; moe its experts too."""
    assert "arch" not in get_size("tiny").as_dict()
    llama = get_size("8b", "llama3").as_dict()
    # Meta's Llama-3 8B: 32 layers of d 4096, 32 heads, 8 KV heads, SwiGLU 14336, rope theta 500,000, 128,256 tokens
    assert {k: llama[k] for k in ("arch", "n_kv_heads", "d_ff", "rope_theta", "params_published")} == {
        "arch": "llama3", "n_kv_heads": 8, "d_ff": 14336, "rope_theta": 500000.0, "params_published": 8_030_261_248}
    assert llama["flops_per_token_torchtitan"] == 6 * llama["params_nonembedding"] + 12 * 32 * 32 * 128 * 8192
    moe = get_size("tiny", "moe").as_dict()
    assert {k: moe[k] for k in ("arch", "head_dim", "n_experts", "top_k", "n_shared_experts", "balancing",
                                "params_active", "flops_per_token_total")} == {
        "arch": "moe", "head_dim": 32, "n_experts": 8, "top_k": 2, "n_shared_experts": 0, "balancing": "bias",
        "params_active": 1_840_256 - 1_179_648, "flops_per_token_total": 6 * 1_807_488 + 12 * 4 * 128 * 128}

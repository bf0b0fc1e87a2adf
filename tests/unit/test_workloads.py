"""Workloads: exact parameter counts, FLOPs/token vs FlopCounterMode, learnable data."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from workloads.data import MarkovData
from workloads.model import Decoder, lm_loss
from workloads.sizes import FAMILIES, SIZES, get_size, seq_len_error


@pytest.mark.parametrize("name", list(SIZES))
def test_param_count_formula_matches_model(name):
    size = get_size(name)
    with torch.device("meta"):
        model = Decoder(size)
    assert sum(p.numel() for p in model.parameters()) == size.params


def test_sizes_span_tiny_to_13b():
    assert get_size("small").params_nonembedding == pytest.approx(124e6, rel=0.01)
    assert 1.3e9 <= get_size("xl").params <= 1.5e9
    with pytest.raises(ValueError, match="unknown gpt2 size 'huge'; choose from tiny, mini, deep, small"):
        get_size("huge")


def counted_flops_per_token(size) -> float:
    """FlopCounterMode's fwd+bwd FLOPs per token of one seeded step of ``size`` (math SDPA: attention counted)."""
    torch.manual_seed(0)
    model = Decoder(size)
    x = torch.randint(0, size.vocab_size, (2, size.seq_len))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        lm_loss(model(x), x).backward()
    return counter.get_total_flops() / x.numel()


@pytest.mark.parametrize("arch,name,seq", [("gpt2", "tiny", 128), ("gpt2", "mini", 128), ("gpt2", "small", 64),
                                           ("llama3", "tiny", 128), ("llama3", "mini", 256)])
def test_flops_per_token_matches_flop_counter(arch, name, seq):
    """PaLM 6N + 12LdS within 2% of the counted fwd+bwd FLOPs (math SDPA so attention is counted), for
    gpt2 and for llama3 (GQA's narrower k/v, SwiGLU's three matrices)."""
    size = replace(get_size(name, arch), seq_len=seq)
    assert counted_flops_per_token(size) == pytest.approx(size.flops_per_token(), rel=0.02)
    # Megatron's causal-halved count is strictly lower by 6*L*d*S.
    assert size.flops_per_token() - size.flops_per_token_megatron() == 6 * size.n_layers * size.d_model * seq


# Meta's published parameter counts of the released checkpoints (Llama 3.2 1B and 3B tie the LM head
# to the token embedding; Llama 3.1 8B, 70B and 405B do not).
META_PARAMS = {"1b": 1_235_814_400, "3b": 3_212_749_824, "8b": 8_030_261_248, "70b": 70_553_706_496,
               "405b": 405_853_388_800}


@pytest.mark.parametrize("name", list(META_PARAMS))
def test_llama3_counts_are_metas_exactly(name):
    size = get_size(name, "llama3")
    assert size.params_published == META_PARAMS[name]
    # the harness trains an untied head: one more vocab x d matrix where Meta ties it
    assert size.params - size.params_published == (size.d_model * size.vocab_size if size.tied_published else 0)


@pytest.mark.parametrize("name", ["tiny", "mini", "1b"])
def test_llama3_param_count_formula_matches_model(name):
    size = get_size(name, "llama3")
    with torch.device("meta"):
        model = Decoder(size)
    assert sum(p.numel() for p in model.parameters()) == size.params
    assert not any(n.endswith(".bias") for n, _ in model.named_parameters())  # no biases
    assert model.embed.pos is None  # RoPE: no position table
    assert model.blocks["0"].attn.k.out_features == size.n_kv_heads * size.head_dim  # grouped-query k/v


def test_llama3_swiglu_width_is_metas_rounding():
    """int(2/3 x 4d), times ffn_dim_multiplier, rounded up to multiple_of: Meta's published hidden widths."""
    assert {n: get_size(n, "llama3").d_ff for n in ("1b", "3b", "8b", "70b", "405b")} == \
        {"1b": 8192, "3b": 8192, "8b": 14336, "70b": 28672, "405b": 53248}


def test_flop_conventions_side_by_side_on_llama3_8b():
    """torchtitan's count equals PaLM's (H x head_dim = d); both sit 12.5% above Megatron's causal count at 8,192."""
    flops = get_size("8b", "llama3").flops_by_convention()
    assert flops["torchtitan"] == flops["palm"]
    assert flops["palm"] / flops["megatron"] == pytest.approx(1.125, abs=0.001)


def test_sizes_are_looked_up_per_family_and_by_key():
    assert get_size("tiny").arch == "gpt2" and get_size("tiny", "llama3").arch == "llama3"
    assert get_size("llama3-8b") is FAMILIES["llama3"]["8b"]
    assert get_size("tiny", "llama3").key == "llama3-tiny" and get_size("tiny").key == "tiny"
    with pytest.raises(ValueError, match="unknown llama3 size 'xl'; choose from tiny, mini, 1b"):
        get_size("xl", "llama3")
    with pytest.raises(ValueError, match="unknown architecture 'mamba'"):
        get_size("tiny", "mamba")


def test_rope_has_no_position_table_to_cap_the_sequence():
    assert seq_len_error(get_size("tiny", "llama3"), 4096) is None
    assert "exceeds tiny's position table (128)" in seq_len_error(get_size("tiny"), 4096)


def test_markov_data_is_seeded_and_learnable():
    d = MarkovData(256, 32, seed=3)
    x1, y1 = d.batch(5, 4)
    x2, y2 = MarkovData(256, 32, seed=3).batch(5, 4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next tokens
    assert not torch.equal(d.batch(6, 4)[0], x1)
    assert 0.3 < d.entropy_floor < 0.6 * d.uniform_loss  # far below ln V: there is something to learn


def test_entropy_floor_matches_empirical_conditional_entropy():
    d = MarkovData(64, 512, seed=1)
    x, y = d.batch(0, 64)
    # Empirical cross entropy of the true transition table on sampled data ~ entropy rate.
    p = np.zeros((64, 64))
    for i in range(64):
        for s, q in zip(d._succ[i], d._probs[i]):
            p[i, s] += q
    nll = -np.log(p[x.numpy().ravel(), y.numpy().ravel()]).mean()
    assert nll == pytest.approx(d.entropy_floor, rel=0.05)
    assert math.isfinite(d.uniform_loss)


def test_uniform_loss_is_ln_vocab_and_what_a_know_nothing_model_scores():
    for vocab in (256, 1000, 50304):
        assert MarkovData(vocab, 8).uniform_loss == math.log(vocab)
    d = MarkovData(256, 16, seed=2)
    _, y = d.batch(0, 4)
    flat_logits = torch.zeros(y.numel(), 256)  # every token equally likely
    loss = torch.nn.functional.cross_entropy(flat_logits, y.reshape(-1)).item()
    assert loss == pytest.approx(d.uniform_loss, rel=1e-6)
    assert d.uniform_loss == pytest.approx(5.545177444479562, rel=1e-15)


def test_tiny_size_counts_and_flops_by_hand():
    """tiny: L 4, d 128, V 256, S 128; per layer 12 d^2 + 13 d (4 projections with bias, MLP 4d with bias,
    two LayerNorms); N = L (12 d^2 + 13 d) + 2 d (final norm) + d V (untied head)."""
    s = get_size("tiny")
    assert (s.head_dim, s.d_ff) == (32, 512)
    assert s.params_per_layer == 12 * 128**2 + 13 * 128 == 198_272
    assert s.params_embedding == 256 * 128 + 128 * 128 == 49_152
    assert s.params_nonembedding == 4 * 198_272 + 2 * 128 + 128 * 256 == 826_112
    assert s.params == 826_112 + 49_152 == 875_264
    assert s.flops_per_token() == 6 * 826_112 + 12 * 4 * 128 * 128 == 5_743_104
    assert s.flops_per_token_megatron() == 6 * 826_112 + 6 * 4 * 128 * 128 == 5_349_888
    assert s.flops_per_token(seq_len=64) == 6 * 826_112 + 12 * 4 * 128 * 64 == 5_349_888
    assert s.flops_per_token_megatron(seq_len=64) == 6 * 826_112 + 6 * 4 * 128 * 64 == 5_153_280
    assert s.as_dict() == {
        "name": "tiny", "n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128, "vocab_size": 256,
        "params": 875_264, "params_nonembedding": 826_112,
        "flops_per_token": 5_743_104, "flops_per_token_megatron": 5_349_888,
    }


def test_gpu_sizes_match_the_recorded_workloads():
    # As the H200 records of results/gpu carry them (workload.*), and GPT-2/3 shapes.
    small = get_size("small")
    assert (small.n_layers, small.d_model, small.n_heads, small.seq_len, small.vocab_size) == (12, 768, 12, 1024, 50304)
    assert (small.params, small.params_nonembedding, small.flops_per_token()) == (163_109_376, 123_689_472, 855_383_040)
    assert small.flops_per_token_megatron() == 798_759_936
    assert [(get_size(n).n_layers, get_size(n).d_model, get_size(n).n_heads) for n in ("medium", "large", "xl")] == [
        (24, 1024, 16), (24, 1536, 16), (24, 2048, 16)]
    assert [n for n in SIZES if SIZES[n].device_kind == "cpu"] == ["tiny", "mini", "deep"]
    deep, tiny = get_size("deep"), get_size("tiny")  # tiny's block, twice the layers: one per stage of 8
    assert (deep.n_layers, deep.d_model, deep.n_heads, deep.seq_len, deep.vocab_size) == (8, 128, 4, 128, 256)
    # four more blocks of 12 d^2 weights and 13 d biases and norm parameters each (GPT-2's block, by hand)
    assert deep.params_nonembedding - tiny.params_nonembedding == 4 * (12 * 128**2 + 13 * 128)

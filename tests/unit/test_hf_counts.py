"""A config model's counts against ``transformers`` (a test-only oracle) and ``FlopCounterMode``.

The configs in tests/data/hf_configs are the publishers' (tests/data/hf_configs/SOURCES.md says where each was
copied from). For each: the harness's published count equals the parameters ``transformers`` builds from the same
config on the meta device; an MoE's active count equals the one counted here from that model's own tensors (its
expert tensors at k of E); the harness's own module tree holds exactly its own count, at full size and shrunk; and
the shrunk instance's FLOPs per token, counted by ``FlopCounterMode``, equal each convention's formula.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from workloads.hf_models import SUPPORTED, config_model, model_type_of
from workloads.model import Decoder, lm_loss

DATA = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
CONFIGS = sorted(p for p in DATA.glob("*.json") if p.stem != "gpt-oss-20b")  # gpt_oss: refused (test_model_inputs)
PUBLISHED = {  # the publisher's own figure, total (and activated) parameters, where SOURCES.md names it
    "llama-3.1-8b": 8.03e9, "llama-3.2-1b": 1.23e9, "llama-2-7b": 6.74e9, "mistral-7b-v0.1": 7.24e9, "qwen2.5-7b": 7.61e9,
    "qwen3-8b": 8.2e9, "qwen3-0.6b": 0.6e9, "olmo-2-1124-7b": 7.30e9, "gpt2": 124e6, "pythia-1.4b": 1_414_647_808,
    "mpt-7b": 6.7e9, "mixtral-8x7b-v0.1": (46.7e9, 12.9e9), "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9), "deepseek-v3": (671e9, 37e9), "kimi-k2": (1.026e12, 32e9)}


def _hf_model(path: Path):
    content = json.loads(path.read_text())
    model_type, _ = model_type_of(content, str(path))
    config = type(AutoConfig.for_model(model_type)).from_dict(content)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), config


def test_the_configs_cover_every_supported_architecture_and_at_least_twelve_models():
    types = {model_type_of(json.loads(p.read_text()), str(p))[0] for p in CONFIGS}
    assert types == set(SUPPORTED) and len(CONFIGS) >= 12


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_published_count_equals_transformers_on_the_meta_device(path):
    size = config_model(str(path))
    model, config = _hf_model(path)
    assert size.params_published == sum(p.numel() for p in model.parameters())
    if size.moe is not None:  # active: every tensor but the routed experts', which count k of E
        e, k = size.moe.n_experts, size.moe.top_k
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert size.params_active_published * e == sum(p.numel() for p in model.parameters()) * e - routed * (e - k)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_counts_are_the_publishers_figures(path):
    size = config_model(str(path))
    figure = PUBLISHED[path.stem]
    total, active = figure if isinstance(figure, tuple) else (figure, None)
    assert size.params_published == pytest.approx(total, rel=0.015)
    if active is not None:
        assert size.params_active_published == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_the_harness_module_tree_holds_its_count_full_size_and_shrunk(path):
    for shrunk in (False, True):
        size = config_model(str(path), shrunk=shrunk)
        with torch.device("meta"):
            model = Decoder(size)
        assert sum(p.numel() for p in model.parameters()) == size.params, shrunk


def _one_per_architecture() -> list[Path]:
    seen: dict[str, Path] = {}
    for p in CONFIGS:
        seen.setdefault(model_type_of(json.loads(p.read_text()), str(p))[0], p)
    return list(seen.values())


@pytest.mark.parametrize("path", _one_per_architecture(), ids=lambda p: p.stem)
def test_flops_per_token_of_a_shrunk_instance_match_flop_counter_mode(path):
    """Every convention against torch's own count of one seeded step (math SDPA, so the attention square is
    counted in full): PaLM's within 2% (norms, softmax and RoPE are not matmuls), Megatron's the causal half of
    the same attention term, torchtitan's equal to PaLM's."""
    size = config_model(str(path), shrunk=True)
    torch.manual_seed(0)
    model = Decoder(size)
    x = torch.randint(0, size.vocab_size, (2, size.seq_len))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        lm_loss(model(x), x).backward()
    counted = counter.get_total_flops() / x.numel()
    assert counted == pytest.approx(size.flops_per_token(), rel=0.02)
    # attention: 6 L S (H x (q/k head + v head)) at full square, half of it causal
    attention = 6 * size.n_layers * size.seq_len * size.n_heads * (size.head_dim + size.v_head_dim)
    assert size.flops_per_token() - size.flops_per_token_megatron() == attention // 2
    assert size.flops_per_token_torchtitan() == size.flops_per_token()

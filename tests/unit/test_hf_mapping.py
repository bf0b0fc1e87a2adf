"""What each architecture's config maps onto, and the shrink rules, with the values worked out here by hand from the
published configs (tests/data/hf_configs) and the rules as docs/models.md states them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from harness.cli import main
from workloads.describe import seq_len_error
from workloads.hf_models import config_model
from workloads.shrink import shrink

DATA = Path(__file__).resolve().parents[1] / "data" / "hf_configs"


def _model(name: str, shrunk: bool = False):
    return config_model(str(DATA / f"{name}.json"), shrunk=shrunk)


def test_deepseek_v3_maps_onto_mla_shared_experts_dense_first_blocks_and_grouped_routing():
    m = _model("deepseek-v3")
    assert (m.mla.q_rank, m.mla.kv_rank, m.mla.nope_dim, m.mla.rope_dim, m.mla.v_dim) == (1536, 512, 128, 64, 128)
    assert (m.head_dim, m.v_head_dim, m.rotary_dim, m.kv_heads) == (192, 128, 64, 128)  # MLA: every head its own k, v
    e = m.moe
    assert (e.n_experts, e.top_k, e.d_ff, e.n_shared, e.score, e.n_group, e.topk_group, e.routed_scale, e.norm_topk) \
        == (256, 8, 2048, 1, "sigmoid", 8, 4, 2.5, True)
    assert (m.dense_layers, m.dense_d_ff, m.moe_layers, m.layer_ff(0), m.is_moe_layer(2), m.is_moe_layer(3)) == \
        (3, 18432, 58, 18432, False, True)
    # the 58 MoE blocks' routed experts idle but 8 of 256 per token: 58 x 248 x 3 x 7168 x 2048 parameters
    assert m.params - m.params_active == 58 * 248 * 3 * 7168 * 2048


def test_deepseek_v3_shrinks_to_its_structure_at_cpu_scale():
    """By the rules: 4 blocks (1 dense), d 128, 4 MLA heads of 16 + 8 (v 16), ranks in their ratio to d rounded to 8
    (1536 x 128 / 7168 = 27.4 -> 24; 512 x 128 / 7168 = 9.1 -> 8), widths to 16 (2048 x 128 / 7168 = 36.6 -> 32;
    18432 x 128 / 7168 = 329 -> 336), 8 experts in 4 groups of 2, top-k 8 x 8 / 256 = 0.25 -> at least 2, top
    groups 4 x 4 / 8 = 2 (2 groups of 2 hold the 2 chosen), the shared expert kept."""
    s = _model("deepseek-v3", shrunk=True)
    assert (s.n_layers, s.dense_layers, s.d_model, s.n_heads, s.vocab_size, s.seq_len) == (4, 1, 128, 4, 256, 128)
    assert (s.mla.q_rank, s.mla.kv_rank, s.mla.nope_dim, s.mla.rope_dim, s.mla.v_dim) == (24, 8, 16, 8, 16)
    assert (s.moe.n_experts, s.moe.top_k, s.moe.d_ff, s.moe.n_group, s.moe.topk_group, s.moe.n_shared) == \
        (8, 2, 32, 4, 2, 1)
    assert (s.dense_d_ff, s.moe.score, s.moe.routed_scale) == (336, "sigmoid", 2.5)
    assert s.name.endswith("-cpu2") and s.origin.shrink == "cpu2" and s.device_kind == "cpu"


def test_qwen3_moe_keeps_its_group_ratio_and_head_width_ratio():
    """32 heads over 4 kv heads (a group of 8): 2 kv heads, 16 heads; head_dim 128 against d / heads 64 is 2x, so at d
    128 over 16 heads (8) it is 16; experts' width 768 x 128 / 2048 = 48; top-k 8 x 8 / 128 = 0.5 -> 2."""
    s = _model("qwen3-30b-a3b", shrunk=True)
    assert (s.n_heads, s.kv_heads, s.head_dim, s.qk_norm) == (16, 2, 16, "head")
    assert (s.moe.n_experts, s.moe.top_k, s.moe.d_ff, s.moe.norm_topk) == (8, 2, 48, True)


@pytest.mark.parametrize("name,expected", [
    # name: (norm, norm bias, bias, qkv bias, positions, rotary of head, parallel residual, norm after, q/k norm)
    ("qwen2.5-7b", ("rmsnorm", False, False, True, "rope", 1.0, False, False, None)),
    ("olmo-2-1124-7b", ("rmsnorm", False, False, False, "rope", 1.0, False, True, "proj")),
    ("pythia-1.4b", ("layernorm", True, True, False, "rope", 0.25, True, False, None)),
    ("mpt-7b", ("layernorm", False, False, False, "alibi", 0.0, False, False, None)),
    ("gpt2", ("layernorm", True, True, False, "learned", 0.0, False, False, None)),
    ("qwen3-8b", ("rmsnorm", False, False, False, "rope", 1.0, False, False, "head")),
])
def test_each_dense_architecture_s_parts(name, expected):
    m = _model(name)
    rotary = m.rotary_dim / m.head_dim
    assert (m.norm, m.norm_bias, m.bias, m.qkv_bias, m.positions, rotary, m.parallel_residual, m.norm_after,
            m.qk_norm) == expected
    s = _model(name, shrunk=True)  # the shrink keeps every part
    assert (s.norm, s.norm_bias, s.bias, s.qkv_bias, s.positions, s.rotary_dim / s.head_dim, s.parallel_residual,
            s.norm_after, s.qk_norm) == expected


def test_tied_heads_learned_tables_and_sliding_windows():
    gpt2 = _model("gpt2")
    assert gpt2.tied_published and gpt2.params - gpt2.params_published == 768 * 50257
    assert (gpt2.position_rows, _model("gpt2", shrunk=True).position_rows) == (1024, 128)
    assert seq_len_error(gpt2, 2048) and not seq_len_error(gpt2, 1024)
    mistral = _model("mistral-7b-v0.1")
    assert (mistral.sliding_window, mistral.seq_len) == (4096, 4096)  # the default stays inside the window
    assert "sliding_window (4096)" in seq_len_error(mistral, 8192) and seq_len_error(mistral, 4096) is None
    assert shrink(replace(mistral, n_layers=2)).sliding_window is None


def test_a_model_type_read_by_its_architectures_says_so():
    kimi = _model("kimi-k2")
    assert kimi.mla is not None and kimi.moe.n_experts == 384
    assert "model_type 'kimi_k2' read as deepseek_v3 (architectures DeepseekV3ForCausalLM)" in kimi.origin.notes


def test_nothing_is_ignored_silently(tmp_path):
    """A field the mapping does not know is named; dropout and the untied head are said."""
    content = {**json.loads((DATA / "gpt2.json").read_text()), "reorder_heads": True}
    path = tmp_path / "gpt2-x.json"
    path.write_text(json.dumps(content))
    notes = config_model(str(path)).origin.notes
    assert any(n.startswith("not read: reorder_heads (unknown to the gpt2 mapping") for n in notes), notes
    assert any("resid_pdrop 0.1: not modelled" in n for n in notes)
    assert any(n.startswith("tie_word_embeddings: the harness trains an untied LM head") for n in notes)


def test_the_cell_id_names_the_model_its_digest_and_the_shrink(tmp_path, capsys):
    """Two files of one name and other content never share an id."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    qwen = json.loads((DATA / "qwen3-8b.json").read_text())
    (a / "m.json").write_text(json.dumps(qwen))
    (b / "m.json").write_text(json.dumps({**qwen, "num_hidden_layers": 30}))
    ids = []
    for folder in (a, b):
        assert main(["plan", "--model", str(folder / "m.json"), "--gpus", "2", "--strategies", "ddp"]) == 0
        ids.append([ln.split("|")[1].strip() for ln in capsys.readouterr().out.splitlines() if "-ddp-" in ln][0])
    assert ids[0].startswith("m-") and ids[0].split("-")[1] != ids[1].split("-")[1]
    assert ids[0] == f"m-{config_model(str(a / 'm.json')).origin.digest[:6]}-cpu2-ddp-fp32-w2-gb8-strong"

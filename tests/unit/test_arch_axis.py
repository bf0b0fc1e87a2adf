"""The architecture axis (``--arch gpt2,llama3``): in the cell id, config and fingerprint only when
pulled, planned and refused like every axis, and the llama3 block's RoPE as Meta's reference has it."""

from __future__ import annotations

import math

import pytest
import torch

from harness.cli import main
from harness.errors import UsageError
from harness.planner import expand
from harness.records.record import fingerprint_fields
from harness.spec import SweepSpec
from workloads.model import apply_rope, rope_angles


def _spec(**kw) -> SweepSpec:
    base = dict(sizes=("tiny",), strategies=("ddp", "tp"), precisions=("fp32",), gpus=(2,), device_kind="cpu",
                batch=8, steps=3, warmup=1, reference=False)
    return SweepSpec(**{**base, **kw})


def test_arch_crosses_like_any_axis_and_gpt2_cells_keep_their_ids_and_fingerprints():
    cells = {c.cell_id: c for c in expand(_spec(archs=("gpt2", "llama3")))}
    assert set(cells) == {"tiny-ddp-fp32-w2-gb8-strong", "tiny-tp-fp32-w2-gb8-strong",
                          "llama3-tiny-ddp-fp32-w2-gb8-strong", "llama3-tiny-tp-fp32-w2-gb8-strong"}
    gpt2 = cells["tiny-ddp-fp32-w2-gb8-strong"].config.to_dict()
    llama = cells["llama3-tiny-ddp-fp32-w2-gb8-strong"].config.to_dict()
    assert gpt2["arch"] == "gpt2" and llama["arch"] == "llama3"
    assert "arch" not in fingerprint_fields(gpt2, {}, None)  # records from before the axis keep their fingerprints
    assert fingerprint_fields(llama, {}, None)["arch"] == "llama3"
    assert cells["llama3-tiny-ddp-fp32-w2-gb8-strong"].config.workload_key == "llama3-tiny"


def test_tp_that_does_not_divide_the_kv_heads_is_refused_at_plan_time():
    cells = {c.cell_id: c for c in expand(_spec(archs=("llama3",), gpus=(4,), strategies=("tp", "fsdp+tp")))}
    tp4 = cells["llama3-tiny-tp-fp32-w4-gb8-strong"]
    assert not tp4.valid
    assert tp4.reason == ("tp (4) must divide n_kv_heads (2): grouped-query attention shards whole key/value heads; "
                          "choose tp in {1, 2}")
    assert cells["llama3-tiny-fsdp+tp-fp32-w4-gb8-strong"].valid  # tp = 2 divides 2 KV heads


def test_llama3_runs_past_gpt2s_position_table():
    cells = {c.cell_id: c for c in expand(_spec(archs=("gpt2", "llama3"), strategies=("ddp",), seq_lens=(512,)))}
    assert cells["llama3-tiny-ddp-fp32-w2-gb8-strong-s512"].valid
    assert "exceeds tiny's position table (128)" in cells["tiny-ddp-fp32-w2-gb8-strong-s512"].reason


def test_plan_only_sizes_are_refused_before_a_bench():
    with pytest.raises(UsageError, match=r"llama3 70b \(70.6B parameters\) is for harness plan and harness fit only"):
        expand(_spec(archs=("llama3",), sizes=("70b",)))


@pytest.mark.parametrize("args,message", [
    (["--arch", "mamba"], "--arch 'mamba': choose from gpt2, llama3"),
    (["--arch", "llama3", "--sizes", "xl"], "--sizes: unknown llama3 size 'xl'; choose from tiny, mini, 1b, 3b, 8b"),
])
def test_bad_arch_or_size_exits_2_with_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert main(["bench", "--device", "cpu", "--no-calibrate", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_plan_ranks_llama3_8b_with_mfu_by_named_conventions(capsys):
    assert main(["plan", "--arch", "llama3", "--sizes", "8b", "--gpus", "8", "--device", "h100",
                 "--seq-len", "8192", "--strategies", "fsdp,tp"]) == 0
    out = capsys.readouterr().out
    assert "workload: llama3 8b (8.03B params), seq 8192, global batch 8 sequences (1 per device" in out
    assert "MFU % (PaLM)" in out and "MFU % (Megatron causal)" in out
    assert "tp (8) must divide n_kv_heads" not in out  # 8 KV heads: tp = 8 is valid for 8b


def test_rope_rotates_pairs_as_metas_complex_form():
    """Meta's reference: view (even, odd) pairs as complex numbers and multiply by exp(i m theta_k)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 8)
    cos, sin = rope_angles(16, 8, 500_000.0, "cpu")
    # Meta's precompute_freqs_cis (llama/model.py), written out here, not taken from rope_angles:
    # freqs = 1 / theta ** (arange(0, dim, 2)[: dim // 2] / dim); freqs_cis = polar(1, outer(t, freqs))
    dim, theta = 8, 500_000.0
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    freqs = torch.polar(torch.ones(16, dim // 2), torch.outer(torch.arange(16).float(), inv))
    # one angle by hand: position 5, pair 1 of a head of 8 turns by 5 / 500000 ** (2 / 8) radians
    assert math.isclose(math.atan2(sin[5, 1].item(), cos[5, 1].item()), 5 / 500_000 ** 0.25, rel_tol=1e-6)
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs).flatten(-2)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)
    # position 0 is not rotated; a later one is, and the rotation keeps each pair's norm
    torch.testing.assert_close(apply_rope(x, cos, sin)[..., 0, :], x[..., 0, :])
    assert not torch.allclose(apply_rope(x, cos, sin)[..., 5, :], x[..., 5, :])
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))

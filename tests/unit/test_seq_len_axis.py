"""The sequence-length axis (``--seq-len 64,128``): crossed like every axis in bench, plan and fit, in the
cell id only off the size's own length, refused per cell where a size cannot run it, and bad values
one line and exit 2."""

from __future__ import annotations

import re

import pytest

from harness.cli import build_parser, main
from harness.cli.args import spec_from_args
from harness.fit.cell import plan_fit_cell
from harness.model.whatif import plan_at_scale
from harness.planner import expand
from harness.spec import SweepSpec, cell_id_of


def _spec(**kw) -> SweepSpec:
    base = dict(sizes=("tiny",), strategies=("ddp",), precisions=("fp32",), gpus=(2,), device_kind="cpu",
                batch=8, steps=3, warmup=1, reference=False)
    return SweepSpec(**{**base, **kw})


def test_seq_lens_cross_and_only_off_default_cells_carry_the_length_in_their_id():
    cells = expand(_spec(seq_lens=(64, 128, 256)))  # tiny's own length is 128
    ids = [c.cell_id for c in cells]
    assert ids == ["tiny-ddp-fp32-w2-gb8-strong-s64", "tiny-ddp-fp32-w2-gb8-strong", "tiny-ddp-fp32-w2-gb8-strong-s256"]
    assert [c.raw["seq_len"] for c in cells] == [64, 128, 256]
    assert [c.valid for c in cells] == [True, True, False]
    assert cells[0].config.seq_len == 64 and cells[0].config.tokens_per_step == 8 * 64
    assert cells[2].reason.startswith("seq_len (256) exceeds tiny's position table (128)")


def test_seq_lens_cross_with_the_other_axes_and_each_group_gets_its_reference_first():
    cells = expand(_spec(seq_lens=(64, 128), archs=("gpt2", "llama3"), acs=("none", "full"), reference=True))
    ids = [c.cell_id for c in cells]
    assert len(ids) == len(set(ids)) == 2 * 2 * 2 * 2  # archs x seq lens x ac x (reference, ddp)
    assert ids[:5] == ["tiny-single-fp32-w1-gb8-strong-s64", "tiny-single-fp32-w1-gb8-strong-ac-full-s64",
                       "tiny-ddp-fp32-w2-gb8-strong-s64", "tiny-ddp-fp32-w2-gb8-strong-ac-full-s64",
                       "tiny-single-fp32-w1-gb8-strong"]
    assert "llama3-tiny-ddp-fp32-w2-gb8-strong" in ids  # llama3 tiny's own length is 128 too
    assert all(c.valid for c in cells)


def test_the_default_is_each_sizes_own_length():
    cells = expand(_spec(sizes=("tiny", "mini")))
    assert {c.cell_id: c.raw["seq_len"] for c in cells} == {"tiny-ddp-fp32-w2-gb8-strong": 128,
                                                            "mini-ddp-fp32-w2-gb8-strong": 256}


def test_cell_id_of_old_and_unknown_raw_dicts():
    raw = dict(size="tiny", strategy="ddp", precision="fp32", world_size=2, global_batch=8, scaling="strong",
               lr_rule="none", grad_accum=1, seq_len=64)  # no arch: a record from before the axis, gpt2
    assert cell_id_of(raw) == "tiny-ddp-fp32-w2-gb8-strong-s64"
    assert cell_id_of({**raw, "seq_len": 128}) == "tiny-ddp-fp32-w2-gb8-strong"
    assert cell_id_of({**raw, "arch": "llama3", "seq_len": 128}) == "llama3-tiny-ddp-fp32-w2-gb8-strong"
    assert cell_id_of({**raw, "size": "huge"}) == "huge-ddp-fp32-w2-gb8-strong"  # unknown size: no part
    assert cell_id_of({k: v for k, v in raw.items() if k != "seq_len"}) == "tiny-ddp-fp32-w2-gb8-strong"


def _spec_of(argv: list[str]) -> SweepSpec:
    return spec_from_args(build_parser().parse_args(["plan", "--device", "cpu", *argv]))


@pytest.mark.parametrize("toml", ["seq_len = [64, 128]\n", 'seq_len = "64,128"\n', 'seq-len = "64, 128"\n'])
def test_a_sweep_file_gives_a_list_a_string_or_an_int(toml, tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(toml)
    assert _spec_of(["--sweep", str(sweep)]).seq_lens == (64, 128)
    sweep.write_text("seq_len = 64\n")
    assert _spec_of(["--sweep", str(sweep)]).seq_lens == (64,)
    assert _spec_of(["--sweep", str(sweep), "--seq-len", "32,64"]).seq_lens == (32, 64)  # the flag wins
    assert _spec_of([]).seq_lens == (None,)


@pytest.mark.parametrize("value", ["0", "abc", "64,x", "-64", "6.4"])
def test_bad_seq_len_exits_2_with_one_line_naming_it(value, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    out = tmp_path / "run"
    rc = main(["bench", "--device", "cpu", "--no-calibrate", "--seq-len", value, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"--seq-len {value!r}: each value must be an integer >= 1, e.g. 512 or 256,512,1024" in err[0]
    assert not out.exists()


def test_a_sweep_files_bad_seq_len_names_the_files_key(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    sweep = tmp_path / "sweep.toml"
    sweep.write_text("seq_len = [128, 0]\n")
    rc = main(["bench", "--device", "cpu", "--no-calibrate", "--sweep", str(sweep), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert f"{sweep}: seq_len '128,0': each value must be an integer >= 1" in err[0]


# ---- harness plan --device PRESET (the what-if) ----

def test_whatif_prints_one_ranking_per_seq_len(capsys, tmp_path):
    assert main(["plan", "--arch", "llama3", "--sizes", "8b", "--gpus", "8", "--device", "h100",
                 "--seq-len", "32768,131072", "--strategies", "fsdp,fsdp+tp", "--error-from", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^\|\s+rank \| strategy", out, re.M)) == 2
    first, second = out.index("## llama3-8b, seq 32768, bf16, 8 GPUs"), out.index("## llama3-8b, seq 131072, bf16, 8 GPUs")
    assert first < out.index("workload: llama3 8b (8.03B params), seq 32768") < second
    assert second < out.index("workload: llama3 8b (8.03B params), seq 131072")
    assert len(re.findall(r"^\|\s+\S+ \| fsdp\+tp ", out, re.M)) == 2


def test_whatif_rows_carry_their_seq_len():
    rows = plan_at_scale("llama3-8b", "h100", 8, ["fsdp", "tp"], seq_len=32768)
    assert {r["seq_len"] for r in rows} == {32768}
    assert {r["seq_len"] for r in plan_at_scale("xl", "h100", 8, ["fsdp", "pp"])} == {1024}  # pp invalid: still there


@pytest.mark.parametrize("value, message", [
    ("0", "--seq-len '0': each value must be an integer >= 1"),
    ("1024,4096", "--seq-len: seq_len (4096) exceeds xl's position table (1024)"),
])
def test_whatif_bad_seq_len_exits_2_before_printing(value, message, capsys):
    assert main(["plan", "--gpus", "8", "--device", "h100", "--sizes", "xl", "--seq-len", value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# ---- harness fit ----

def test_fit_cells_carry_the_length_only_off_default():
    assert plan_fit_cell("tiny", "fsdp", "fp32", 2, 1, "cpu").cell_id == "tiny-fsdp-fp32-w2-mb1"
    assert plan_fit_cell("tiny", "fsdp", "fp32", 2, 1, "cpu", seq_len=128).cell_id == "tiny-fsdp-fp32-w2-mb1"
    assert plan_fit_cell("tiny", "fsdp", "fp32", 2, 1, "cpu", seq_len=64).cell_id == "tiny-fsdp-fp32-w2-mb1-s64"
    assert plan_fit_cell("llama3-8b", "fsdp", "bf16", 8, 1, "cpu", seq_len=4096).cell_id == "llama3-8b-fsdp-bf16-w8-mb1-s4096"


def _fake_record(cell) -> dict:
    config = {"size": cell.size, "strategy": cell.strategy, "precision": cell.precision, "world_size": cell.world_size,
              "degrees": None, "micro_batch": cell.micro_batch, "global_batch": cell.global_batch,
              "seq_len": cell.seq_len, "ac": cell.ac}
    return {"config": config, "status": "ok", "metrics": {"roles": [], "device_mem_gib": 1.0}}


def test_fit_crosses_seq_lens_and_prints_a_table_per_length(tmp_path, capsys, monkeypatch):
    from harness.cli import fit as fit_cli

    fitted = []

    def fake_fit_all(cells, *args, **kwargs):
        fitted.extend(cells)
        return [_fake_record(c) for c in cells]

    monkeypatch.setattr(fit_cli, "fit_all", fake_fit_all)
    assert main(["fit", "--device", "cpu", "--gpus", "2,4", "--strategies", "fsdp,ddp", "--seq-len", "32,64",
                 "--out", str(tmp_path / "fit")]) == 0
    ids = [c.cell_id for c in fitted]
    assert len(ids) == len(set(ids)) == 2 * 2 * 2  # seq lens x gpus x strategies
    assert {c.seq_len for c in fitted} == {32, 64}
    assert "tiny-fsdp-fp32-w4-mb1-s32" in ids and "tiny-ddp-fp32-w2-mb1-s64" in ids
    out = capsys.readouterr().out
    assert out.index("seq 32:") < out.index("seq 64:")
    assert "--seq-len 32,64" in (tmp_path / "fit" / "fit.md").read_text()


@pytest.mark.parametrize("value, message", [
    ("abc", "harness fit: error: --seq-len 'abc': each value must be an integer >= 1, e.g. 512 or 256,512,1024"),
    ("0", "harness fit: error: --seq-len '0': each value must be an integer >= 1, e.g. 512 or 256,512,1024"),
    ("64,4096", "harness fit: error: --seq-len: seq_len (4096) exceeds tiny's position table (128); use --seq-len "
                "<= 128, or --arch llama3 (RoPE has no table)"),
])
def test_fit_bad_seq_len_exits_2_with_one_line(value, message, tmp_path, capsys):
    assert main(["fit", "--device", "cpu", "--gpus", "2", "--seq-len", value, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == message
    assert not list(tmp_path.iterdir())

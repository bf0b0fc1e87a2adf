"""Unit tests of the report (harness/report.py), plots and records loading."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness import report
from harness.errors import UsageError
from harness.records.reader import load_records
from harness.report import frame, summary
from harness.report.figures import _cell_tick
from harness.report.plot_files import LOSS_PNG, PEAK_MEM_PNG, SCALING_PNG, THROUGHPUT_PNG, write_plots
from harness.report.run_frames import RunFrames

SEQ_LEN = 128
OOM_ERROR = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total capacity; "
             "77.10 GiB already allocated)\nstderr tail ...")


def cell(
    strategy: str, precision: str, world_size: int, tokens_per_s: float | None,
    size: str = "tiny", status: str = "ok", error: str | None = None,
    lr_rule: str = "constant", **metrics: Any,
) -> dict[str, Any]:
    """A cell record following docs/records.md; ``metrics`` override or add metric keys."""
    m: dict[str, Any] = {}
    if tokens_per_s is not None:
        step_s = 16 * SEQ_LEN / tokens_per_s
        m = {"tokens_per_step": 16 * SEQ_LEN, "tokens_per_s": tokens_per_s,
             "tokens_per_s_per_device": tokens_per_s / world_size,
             "step_time_s": {"median": step_s, "cv": 0.02, "n": 10},
             "tflops_per_device": 1e-3 * tokens_per_s / world_size, "mfu_pct": None,
             "mfu_reason": "no datasheet peak for cpu"}
    m.update(metrics)
    return {
        "schema_version": 1, "kind": "cell", "run_id": "20261129-184500-ab12",
        "cell_id": f"{size}-{strategy}-{precision}-w{world_size}-gb16-strong-{lr_rule}",
        "status": status, "error": error, "fingerprint": "0" * 16, "fingerprint_fields": {},
        "config": {"size": size, "strategy": strategy, "precision": precision,
                   "world_size": world_size, "global_batch": 16, "seq_len": SEQ_LEN,
                   "scaling": "strong", "lr_rule": lr_rule, "device_kind": "cpu"},
        "env": {"device_name": "AMD EPYC"},
        "metrics": m,
        "samples": {"step_time_s": []},
    }


@pytest.fixture()
def records() -> list[dict[str, Any]]:
    return [
        cell("ddp", "fp32", 1, 1000.0, peak_mem_gib=2.0, model_state_bytes_per_rank=8 * 2**20),
        cell("ddp", "fp32", 2, 1800.0, peak_mem_gib=2.1, model_state_bytes_per_rank=8 * 2**20,
             comm_bytes_per_step=3 * 2**20, trace={"overlap_pct": 40.0},
             parity_max_rel_diff=2e-6),
        cell("fsdp", "fp32", 2, 1600.0, peak_mem_gib=1.2, model_state_bytes_per_rank=4 * 2**20,
             comm_bytes_per_step=4.5 * 2**20, trace={"overlap_pct": 55.0},
             unstable=True, unstable_reason="unstable: CV 14% > 10%, rerun with more steps"),
        cell("ddp", "bf16", 2, 2400.0, peak_mem_gib=1.5),
        cell("fsdp", "bf16", 2, None, status="oom", error=OOM_ERROR),
    ]


def outcome_records() -> list[dict[str, Any]]:
    """Size 'small': fp32/bf16 x two LR rules with loss outcomes and gradient noise scale."""
    common = {"target_loss": 3.0}
    return [
        cell("ddp", "fp32", 2, 1000.0, size="small", lr_rule="sqrt", final_loss=2.9,
             steps_to_target=40, time_to_target_s=20.0, gns={"b_simple": 64.0},
             loss=[5.0, 4.0, 3.5, 2.9], **common),
        cell("ddp", "bf16", 2, 1500.0, size="small", lr_rule="sqrt", final_loss=2.95,
             steps_to_target=42, time_to_target_s=14.0, gns={"b_simple": 8.0},
             loss=[5.0, 4.1, 3.4, 2.95], **common),
        cell("ddp", "fp32", 2, 1000.0, size="small", lr_rule="linear", final_loss=3.2,
             steps_to_target=None, gns={"b_simple": None, "reason": "too few steps"},
             loss=[5.0, 4.5, 3.9, 3.2], **common),
    ]


def table_rows(markdown: str, size: str) -> list[list[str]]:
    """Cells of the first table after the '## Size: <size>' heading."""
    lines = markdown.split(f"## Size: {size}\n", 1)[1].splitlines()
    table = [line for line in lines[: lines.index("", 1)] if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table]


# ---------------------------------------------------------------- frame


def test_cells_frame_flattens_and_computes_scaling(records: list[dict[str, Any]]) -> None:
    df = frame.cells_frame(records).set_index("cell_id")
    ddp2 = df.loc["tiny-ddp-fp32-w2-gb16-strong-constant"]
    assert ddp2["tokens_per_s_per_device"] == 900.0
    assert ddp2["scaling_efficiency"] == pytest.approx(1800.0 / (2 * 1000.0))  # 0.9
    assert ddp2["model_state_mib_per_rank"] == 8.0
    assert ddp2["comm_mib_per_step"] == 3.0
    assert ddp2["overlap_pct"] == 40.0
    assert ddp2["step_time_median_s"] == pytest.approx(16 * SEQ_LEN / 1800.0)
    # fsdp has no world_size 1 cell: the 1-device ddp fp32 cell is the reference.
    assert df.loc["tiny-fsdp-fp32-w2-gb16-strong-constant", "scaling_efficiency"] == 0.8
    assert df.loc["tiny-ddp-fp32-w1-gb16-strong-constant", "scaling_efficiency"] == 1.0
    # No bf16 1-device cell: efficiency is not invented from the fp32 one.
    assert math.isnan(df.loc["tiny-ddp-bf16-w2-gb16-strong-constant", "scaling_efficiency"])
    oom = df.loc["tiny-fsdp-bf16-w2-gb16-strong-constant"]
    assert oom["status"] == "oom" and math.isnan(oom["tokens_per_s_per_device"])
    assert math.isnan(oom["scaling_efficiency"]) and math.isnan(oom["mfu_pct"])


def test_scaling_reference_prefers_same_strategy_else_fastest() -> None:
    recs = [cell("fsdp", "fp32", 1, 800.0), cell("ddp", "fp32", 1, 1000.0),
            cell("fsdp", "fp32", 2, 1440.0), cell("tp", "fp32", 2, 1500.0)]
    eff = frame.cells_frame(recs).set_index("strategy")["scaling_efficiency"]
    assert eff["fsdp"].tolist() == [1.0, pytest.approx(1440.0 / (2 * 800.0))]
    assert eff["tp"] == pytest.approx(1500.0 / (2 * 1000.0))


def test_cells_frame_ignores_calibration_and_tolerates_missing_keys() -> None:
    bare = {"kind": "cell", "cell_id": "x", "status": "ok"}
    calibration = {"kind": "calibration", "cell_id": "calibration", "status": "ok"}
    df = frame.cells_frame([bare, calibration])
    assert list(df["cell_id"]) == ["x"]
    assert list(df.columns) == frame.FRAME_COLUMNS
    assert df[["tokens_per_s_per_device", "peak_mem_gib", "overlap_pct"]].isna().all(axis=None)
    assert summary.summary_markdown(RunFrames.of([bare])).startswith("# Benchmark summary, produced on unknown")


# ---------------------------------------------------------------- markdown


def test_summary_table_marks_best_and_shows_failures(records: list[dict[str, Any]]) -> None:
    md = summary.summary_markdown(RunFrames.of(records))
    assert md.startswith("# Benchmark summary, produced on cpu (AMD EPYC)\n")
    header, _, *rows = table_rows(md, "tiny")
    assert header[:4] == ["strategy", "precision", "world size", "tokens/s/dev"]
    assert "peak mem GiB" in header and "comm MiB/step" in header and "scaling eff." in header
    by_key = {tuple(r[:3]): dict(zip(header, r)) for r in rows}
    assert by_key[("ddp", "bf16", "2")]["tokens/s/dev"] == "**1,200**"
    assert by_key[("ddp", "fp32", "2")]["tokens/s/dev"] == "900"
    assert by_key[("fsdp", "fp32", "2")]["peak mem GiB"] == "**1.20**"
    # The 1-device reference (1.00 by definition) is not ranked; the best is 0.90 on 2.
    assert by_key[("ddp", "fp32", "2")]["scaling eff."] == "**0.90**"
    assert by_key[("ddp", "fp32", "1")]["scaling eff."] == "1.00"
    assert by_key[("ddp", "bf16", "2")]["CV %"] == "2.0"  # all tied: nothing bold
    assert by_key[("ddp", "fp32", "2")]["comm MiB/step"] == "**3.0**"
    assert by_key[("fsdp", "fp32", "2")]["overlap %"] == "**55.0**"
    assert by_key[("ddp", "bf16", "2")]["MFU % (PaLM)"] == "n/a"
    oom = by_key[("fsdp", "bf16", "2")]
    assert oom["status"] == f"oom: {OOM_ERROR[:60]}"
    assert oom["tokens/s/dev"] == summary.FAILED_CELL


def test_what_to_pick_names_the_right_cells(records: list[dict[str, Any]]) -> None:
    md = summary.summary_markdown(RunFrames.of(records))
    assert ("**What to pick:** fastest is ddp/bf16 on 2 device(s) at 1,200 tokens/s/dev; "
            "leanest in memory is fsdp/fp32 on 2 device(s) at 1.20 GiB peak; "
            "best scaling is ddp/fp32 on 2 device(s) at efficiency 0.90.") in md


def test_footnotes_and_unstable_flag(records: list[dict[str, Any]]) -> None:
    md = summary.summary_markdown(RunFrames.of(records))
    assert "tokens/s = global tokens per step / median step time" in md
    assert "scaling efficiency = tokens/s at N devices / (N x tokens/s at 1 device)" in md
    assert ("- `tiny-fsdp-fp32-w2-gb16-strong-constant`: unstable: CV 14% > 10%, "
            "rerun with more steps") in md
    assert "- MFU n/a for 4 cell(s): no datasheet peak for cpu" in md
    assert "nan" not in md
    assert "### Loss outcomes" not in md  # no loss outcome data in the tiny set
    assert "parity failed" not in md


def test_failed_parity_is_flagged_with_its_reason(records: list[dict[str, Any]]) -> None:
    reason = "vs tiny-single: gradient norm after step 1 differs by 1.0e+00 > 1e-06"
    records[1]["metrics"]["parity"] = {"ok": False, "reason": reason}
    md = summary.summary_markdown(RunFrames.of(records))
    assert f"- `tiny-ddp-fp32-w2-gb16-strong-constant`: **parity failed**: {reason}" in md


def test_outcome_table() -> None:
    md = summary.summary_markdown(RunFrames.of(outcome_records()))
    header, _, *rows = table_rows(md, "small")
    assert header[:4] == ["strategy", "precision", "world size", "LR rule"]  # LR rule varies
    assert [r[3] for r in rows] == ["sqrt", "linear", "sqrt"]
    section = md.split("### Loss outcomes: small\n", 1)[1]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")][:5]
    header, _, *body = rows
    by_key = {(r[0], r[2]): dict(zip(header, r)) for r in body}
    bf16 = by_key[("bf16", "sqrt")]
    assert bf16["AMP speedup vs fp32"] == "1.50"
    assert bf16["steps to target"] == "42"
    assert bf16["critical-batch hint"] == "batch above B_simple: diminishing returns"
    fp32 = by_key[("fp32", "sqrt")]
    assert fp32["AMP speedup vs fp32"] == "1.00"
    assert fp32["critical-batch hint"] == "batch below B_simple: larger batch would still scale"
    linear = by_key[("fp32", "linear")]
    assert linear["steps to target"] == "not reached"
    assert linear["B_simple"] == "n/a" and linear["critical-batch hint"] == "n/a"
    assert linear["final loss"] == "3.2000"


# ---------------------------------------------------------------- files


def write_run(tmp_path: Path, records: list[dict[str, Any]]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_write_report_files(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    run_dir = write_run(tmp_path, records + outcome_records())
    md = report.write_report(run_dir)
    assert (run_dir / "summary.md").read_text() == md
    csv = pd.read_csv(run_dir / "summary.csv")
    assert len(csv) == 8
    assert csv.set_index("cell_id").loc["tiny-ddp-fp32-w2-gb16-strong-constant",
                                        "scaling_efficiency"] == pytest.approx(0.9)
    for name in (THROUGHPUT_PNG, PEAK_MEM_PNG, SCALING_PNG, LOSS_PNG):
        png = run_dir / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not list(run_dir.glob(".*.tmp")) and not list((run_dir / "plots").glob(".*.tmp"))


def test_plots_skipped_without_data(tmp_path: Path) -> None:
    only_failed = [cell("fsdp", "bf16", 2, None, status="oom", error=OOM_ERROR)]
    assert write_plots(RunFrames.of(only_failed), tmp_path / "plots") == []
    one_size = [cell("ddp", "fp32", 1, 1000.0)]
    written = write_plots(RunFrames.of(one_size), tmp_path / "p2")
    assert [p.name for p in written] == [THROUGHPUT_PNG]


def test_load_records_truncated_line(tmp_path: Path, records: list[dict[str, Any]], capsys) -> None:
    run_dir = write_run(tmp_path, records)
    path = run_dir / "records.jsonl"
    before = load_records(run_dir)
    assert len(before) == len(records) and capsys.readouterr().err == ""
    path.write_text(path.read_text() + '{"kind": "cell", "cell_id": "tr')
    assert load_records(run_dir) == before, "a torn tail hides no complete record"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {path}: line {len(records) + 1} is a torn write")
    with pytest.raises(UsageError, match="no such records file"):
        load_records(tmp_path / "missing")


def test_latest_record_of_a_resumed_cell_wins_and_its_attempts_are_counted(records) -> None:
    timed_out = cell("fsdp", "bf16", 2, None, status="timeout", error="no result within the cell timeout (300 s)")
    retried = cell("fsdp", "bf16", 2, 2000.0, peak_mem_gib=1.1)
    history = [*records, timed_out, retried]  # fsdp/bf16: oom, then timeout, then ok on the last resume
    df = frame.cells_frame(history)
    assert len(df) == len(records), "one row per cell"
    row = df[df["cell_id"] == retried["cell_id"]].iloc[0]
    assert (row["status"], row["tokens_per_s"], row["attempts"]) == ("ok", 2000.0, 3)
    assert df[df["cell_id"] != retried["cell_id"]]["attempts"].eq(1).all()
    md = summary.summary_markdown(RunFrames.of(history))
    assert f"- `{retried['cell_id']}`: 3 attempts; the tables show the latest (ok)" in md
    assert "timeout" not in md.split("**Flags**")[0], "an earlier attempt is history, not a row"


def test_cell_ticks_wrap_at_hyphens_without_losing_a_character() -> None:
    for cell in ("tiny-pp+fsdp-fp32-w4-gb8-strong-1f1b-m4", "tiny-tp-sp-fp32-w4-gb8-strong", "xl-single-bf16-w1"):
        tick = _cell_tick(cell)
        assert tick.replace("\n", "-") == cell
        assert all(len(line) <= 14 for line in tick.splitlines())
    assert _cell_tick("tiny-tp-sp-fp32-w4-gb8-strong") == "tiny-tp-sp\nfp32-w4-gb8\nstrong"


def test_time_line_says_how_much_of_the_run_was_measured_steps() -> None:
    ok = {"launch": 1.0, "imports": 4.0, "process_group": 0.5, "build": 0.5, "warmup": 1.0, "measured": 2.0,
          "extra_steps": 0.75, "profile": 0.0, "result": 0.25, "teardown": 1.0, "machine_probe": 0.5}
    failed = {"job": 6.0, "machine_probe": 0.5}
    records = [cell("ddp", "fp32", 2, 1000.0, overhead={"parts_s": ok}),
               cell("fsdp", "fp32", 2, None, status="crashed", error="rank 1 died", overhead={"parts_s": failed}),
               cell("tp", "fp32", 2, 1000.0)]  # a record from before metrics.overhead: not counted
    line = summary.time_line(frame.cells_frame(records))
    assert line == ("Time: 2 cells took 18 s; 2 s (11%) were measured steps, 6 s start-up (launch, imports, "
                    "process group, model build), 1 s warmup, 1 s untimed steps and results, 1 s teardown, 1 s "
                    "machine probes, 6 s in cells without a result (`metrics.overhead`).")
    assert summary.time_line(frame.cells_frame([cell("tp", "fp32", 2, 1000.0)])) is None


def _rounds(median_s: float, lo: float, hi: float) -> dict[str, Any]:
    return {"n": 5, "medians_s": [lo * 0.9, lo, median_s, hi, hi * 1.1], "ci_s": [lo, hi],
            "spread_pct": 100 * (hi - lo) / 2 / median_s}


def test_rounds_show_their_spread_and_overlapping_cells_are_a_tie_not_a_winner() -> None:
    step = 16 * SEQ_LEN / 1000.0  # ddp fp32 on 2 at 1000 tok/s
    near = 16 * SEQ_LEN / 980.0
    recs = [cell("ddp", "fp32", 2, 1000.0, rounds=_rounds(step, step * 0.97, step * 1.03)),
            cell("fsdp", "fp32", 2, 980.0, rounds=_rounds(near, near * 0.98, near * 1.04)),
            cell("tp", "fp32", 2, 600.0, rounds=_rounds(16 * SEQ_LEN / 600.0, 3.3, 3.5))]
    md = summary.summary_markdown(RunFrames.of(recs))
    header, _, *rows = table_rows(md, "tiny")
    by = {r[0]: dict(zip(header, r)) for r in rows}
    assert by["ddp"]["tokens/s/dev"] == "**500 (tie)**" and by["fsdp"]["tokens/s/dev"] == "**490 (tie)**"
    assert by["tp"]["tokens/s/dev"] == "300"
    assert by["ddp"]["step median (ms)"] == "**2048.00 ± 3.0% (tie)**"
    assert "fastest is ddp/fp32 on 2 device(s) at 500 tokens/s/dev, tied with fsdp/fp32 on 2 device(s)" in md
    apart = [recs[0], recs[2]]  # without the near one, ddp wins outright
    md = summary.summary_markdown(RunFrames.of(apart))
    assert "tied with" not in md
    assert not any("(tie)" in c for r in table_rows(md, "tiny") for c in r)


def test_a_contradicted_cell_is_a_failed_row_with_its_reason(records: list[dict[str, Any]]) -> None:
    """A cell whose run contradicts a claim (harness.run.claims) keeps its metrics as evidence, and the table shows
    it as a failure with the claim, never as a measured row."""
    ok = next(r for r in records if r["status"] == "ok" and r["config"]["strategy"] == "ddp"
              and r["config"]["precision"] == "bf16" and r["config"]["world_size"] == 2)
    lie = "claim contradicted by the run: optimizer adamw-fused: torch's fused AdamW kernel dispatched [0, 0]"
    bad = {**ok, "status": "contradicted", "error": lie}
    md = summary.summary_markdown(RunFrames.of([r for r in records if r is not ok] + [bad]))
    header, _, *rows = table_rows(md, "tiny")
    row = {tuple(r[:3]): dict(zip(header, r)) for r in rows}[("ddp", "bf16", "2")]
    assert row["status"].startswith("contradicted: claim contradicted by the run: optimizer adamw-fused")
    assert row["tokens/s/dev"] == summary.FAILED_CELL

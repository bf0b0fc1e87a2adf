"""The gate's pairing, reasons and table, on records small enough to work out by hand.

Constant step times make every number exact: throughput = tokens per step / step time, the
bootstrap interval collapses onto the ratio, and the Mann-Whitney p-value comes from scipy here.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from scipy.stats import mannwhitneyu

from harness.compare import verdicts as cmp
from harness.compare.cell_normaliser import NO_NORMALISER, Normaliser, run_normaliser
from harness.compare.stats import CompareOptions
from harness.errors import UsageError

OPTS = CompareOptions()
NONE = (NO_NORMALISER, NO_NORMALISER)


def rec(cell_id: str, fp: str, times: list[float] | None = None, status: str = "ok", error: str | None = None,
        precision: str = "fp32", kind: str = "cell", tokens: int | None = 1000, **extra: Any) -> dict[str, Any]:
    r = {"schema_version": 1, "kind": kind, "cell_id": cell_id, "status": status, "error": error, "fingerprint": fp,
         "fingerprint_fields": {"precision": precision, "degrees": {"tp": 1, "pp": 1}},
         "config": {"global_batch": 4, "seq_len": 8}, "metrics": {"tokens_per_step": tokens},
         "samples": {"step_time_s": times if times is not None else [0.5] * 5}}
    r.update(extra)
    return r


# ---------------------------------------------------------------- records -> samples


def test_tokens_per_step_from_metrics_then_config() -> None:
    assert cmp.throughput_samples(rec("a", "f", [0.5, 0.25])).tolist() == [2000.0, 4000.0]
    no_metric = rec("a", "f", [0.5, 0.25], tokens=None)  # config: 4 x 8 = 32 tokens
    assert cmp.throughput_samples(no_metric).tolist() == [64.0, 128.0]
    for missing in ("global_batch", "seq_len"):
        r = rec("a", "f", [0.5], tokens=None)
        del r["config"][missing]
        assert cmp.throughput_samples(r).size == 0, missing
    bare = {"cell_id": "a", "samples": {"step_time_s": [0.5]}}
    assert cmp.throughput_samples(bare).size == 0
    assert cmp.throughput_samples({"cell_id": "a"}).size == 0


@pytest.mark.parametrize("bad", [[0.5, 0.0], [0.5, -1.0], [0.5, math.inf], [math.nan]])
def test_corrupt_step_times_are_refused_naming_the_cell(bad: list[float]) -> None:
    with pytest.raises(UsageError) as e:
        cmp.throughput_samples(rec("tiny-x", "f", bad))
    assert str(e.value) == ("cell 'tiny-x': samples.step_time_s must be finite and > 0; "
                            "the record is corrupt, rerun the cell")


def test_run_normaliser_is_the_median_of_every_calibration_sample_and_probe() -> None:
    records = [rec("a", "f", metrics={"tokens_per_step": 1000, "machine_probe_s": {"before": 7.0, "after": None}}),
               rec("calibration", "c", [3.0, 1.0, 2.0, 10.0], kind="calibration"),
               rec("b", "g", metrics={"tokens_per_step": 1000})]
    n = run_normaliser(records, "base")
    # timings 1, 2, 3, 7, 10: median 3; numpy's linear p10 = 1 + 0.4 * 1, p90 = 7 + 0.6 * 3
    assert n.time_s == 3.0
    assert n.factor == pytest.approx(max(3.0 / 1.4, 8.8 / 3.0), rel=1e-12)
    assert n.evidence == "matmul 1.4-8.8 s, p10-p90 of 5 timings"
    message = ("base: no calibration record with samples.step_time_s (kind == 'calibration') and no cell with "
               "metrics.machine_probe_s; rerun with calibration enabled or use --normalize none")
    for records in ([rec("a", "f")], [rec("calibration", "c", [], kind="calibration")]):
        with pytest.raises(UsageError) as e:
            run_normaliser(records, "base")
        assert str(e.value) == message


def test_fingerprint_diff_names_every_differing_leaf() -> None:
    base = {"precision": "fp32", "degrees": {"tp": 1, "pp": 2}, "torch": "2.13", "gone": 1, "old": None}
    cand = {"precision": "bf16", "degrees": {"tp": 2, "pp": 2}, "torch": "2.13", "new": None}
    assert cmp.fingerprint_diff(base, cand) == (
        "degrees.tp differs (1 vs 2); gone differs (1 vs absent); new differs (absent vs None); "
        "old differs (None vs absent); precision differs (fp32 vs bf16)")
    assert cmp.fingerprint_diff(base, dict(base)) == "fingerprint differs but fingerprint_fields are equal"
    assert cmp.fingerprint_diff({}, {}) == "fingerprint differs but fingerprint_fields are equal"


# ---------------------------------------------------------------- pairing


def test_index_errors_name_label_and_cell() -> None:
    with pytest.raises(UsageError) as e:
        cmp.compare([rec("a", "")], [rec("a", "f")], OPTS)
    assert str(e.value) == "base: cell 'a' has no fingerprint; records must follow docs/records.md schema_version 1"
    with pytest.raises(UsageError) as e:
        cmp.compare([rec("a", "f")], [rec("a", "f"), rec("b", "f")], OPTS, cand_label="new")
    assert str(e.value) == "new: cells 'a' and 'b' share fingerprint f; fingerprints must be unique per cell"
    with pytest.raises(UsageError) as e:
        cmp.compare([rec("calibration", "c", kind="calibration")], [rec("a", "f")], OPTS)
    assert str(e.value) == "base: no cell records (kind == 'cell'); pass a finished run"


def _scenario() -> tuple[list[dict], list[dict]]:
    base = [
        rec("a", "fa", [0.5] * 5),  # 2000 tok/s
        rec("b", "fb", status="oom", error="CUDA out of memory\ntraceback ..."),
        rec("c", "fc1", precision="fp32"),
        rec("d", "fd"),
        rec("calibration", "cal", [2.0, 2.0], kind="calibration"),
        rec("g", "fg", status="crashed", error=None),
        rec("h", "fh"),
        {k: v for k, v in rec("i", "fi").items() if k != "kind"},  # no kind: a cell
    ]
    cand = [
        rec("a", "fa", [0.4] * 5),  # 2500 tok/s
        rec("b", "fb", status="oom", error="CUDA out of memory\ntraceback ..."),
        rec("c", "fc2", precision="bf16"),
        rec("e", "fe"),
        rec("calibration", "cal", [4.0, 4.0], kind="calibration"),
        rec("g", "fg"),
        rec("h", "fh", status="timeout", error="x" * 70),
        rec("i", "fi", [0.5] * 4),
    ]
    return base, cand


def test_compare_rows_exact() -> None:
    base, cand = _scenario()
    df = cmp.compare(base, cand, OPTS)
    assert list(df.columns) == cmp.COLUMNS == [
        "cell_id", "verdict", "base_median_tok_per_s", "cand_median_tok_per_s", "ratio",
        "ci_low", "ci_high", "p_value", "n_base", "n_cand", "base_normaliser_s", "cand_normaliser_s",
        "base_normaliser_spread_pct", "cand_normaliser_spread_pct", "reason"]
    assert df.attrs["throughput_unit"] == "tok/s"
    assert df[["base_normaliser_s", "base_normaliser_spread_pct"]].isna().all().all()  # --normalize none
    rows = {r["cell_id"]: r for r in df.to_dict("records")}
    assert list(rows) == ["a", "b", "c", "d", "g", "h", "i", "e"]
    p = float(mannwhitneyu([2500.0] * 5, [2000.0] * 5, alternative="less").pvalue)
    a = rows["a"]
    assert (a["verdict"], a["base_median_tok_per_s"], a["cand_median_tok_per_s"]) == ("IMPROVED", 2000.0, 2500.0)
    assert (a["ratio"], a["ci_low"], a["ci_high"], a["n_base"], a["n_cand"]) == (1.25, 1.25, 1.25, 5, 5)
    assert a["p_value"] == pytest.approx(p, rel=1e-12)
    assert a["reason"] == "faster by 25.0% (CI [1.250, 1.250])"
    reasons = {k: (r["verdict"], r["reason"]) for k, r in rows.items() if k != "a"}
    assert reasons == {
        "b": ("SKIPPED", "oom on both sides: CUDA out of memory"),
        "c": ("NOT COMPARABLE", "not comparable: precision differs (fp32 vs bf16)"),
        "d": ("MISSING", "only in base; missing from cand"),
        "g": ("NOT COMPARABLE", "base status crashed: no error message; rerun the base cell"),
        "h": ("REGRESSION", "cand status timeout (base ok): " + "x" * 60),
        "i": ("TOO FEW SAMPLES", "5 base and 4 cand samples, need >= 5 per side; rerun with more measured steps"),
        "e": ("MISSING", "only in cand; missing from base"),
    }
    for k in "bcdgeh":
        r = rows[k]
        assert all(math.isnan(r[c]) for c in ("base_median_tok_per_s", "cand_median_tok_per_s", "ratio",
                                               "ci_low", "ci_high", "p_value")), k
        assert (r["n_base"], r["n_cand"]) == (0, 0), k
    i = rows["i"]
    assert (i["base_median_tok_per_s"], i["cand_median_tok_per_s"], i["n_base"], i["n_cand"]) == (2000.0, 2000.0, 5, 4)
    assert math.isnan(i["ratio"]) and math.isnan(i["p_value"])
    assert cmp.exit_code(df) == 1


def test_calibration_normalisation_scales_each_side_by_its_calibration_time() -> None:
    base, cand = _scenario()
    df = cmp.compare(base, cand, CompareOptions(normalize="calibration"), base_label="B", cand_label="C")
    a = df[df["cell_id"] == "a"].iloc[0]
    # base 2000 tok/s x 2 s, cand 2500 tok/s x 4 s: in units of each side's calibration throughput.
    assert (a["base_median_tok_per_s"], a["cand_median_tok_per_s"], a["ratio"]) == (4000.0, 10000.0, 2.5)
    assert (a["base_normaliser_s"], a["cand_normaliser_s"]) == (2.0, 4.0)
    assert (a["base_normaliser_spread_pct"], a["cand_normaliser_spread_pct"]) == (0.0, 0.0)  # two equal samples
    assert df.attrs["throughput_unit"] == "x calibration"
    assert set(df[df["verdict"] == "MISSING"]["reason"]) == {"only in base; missing from C", "only in cand; missing from B"}


def test_unstable_notes_follow_the_reason_base_first() -> None:
    base = [rec("a", "fa", [0.5] * 5, metrics={"tokens_per_step": 1000, "unstable_reason": "unstable: CV 14% > 10%"})]
    cand = [rec("a", "fa", [0.5] * 5, metrics={"tokens_per_step": 1000, "unstable_reason": "unstable: CV 12% > 10%"})]
    df = cmp.compare(base, cand, OPTS)
    assert df["reason"].tolist() == [
        "within +/-5% (ratio 1.000, CI [1.000, 1.000]); base unstable: CV 14% > 10%; cand unstable: CV 12% > 10%"]
    cand[0]["metrics"]["unstable_reason"] = None
    assert cmp.compare(base, cand, OPTS)["reason"].tolist() == [
        "within +/-5% (ratio 1.000, CI [1.000, 1.000]); base unstable: CV 14% > 10%"]


def test_a_record_without_status_is_ok() -> None:
    base, cand = rec("a", "fa", [0.5] * 5), rec("a", "fa", [0.5] * 5)
    del base["status"], cand["status"]
    assert cmp.compare([base], [cand], OPTS)["verdict"].tolist() == ["PASS"]


def test_missing_calibration_names_the_side() -> None:
    with pytest.raises(UsageError, match="^runs/new: no calibration record"):
        cmp.compare([rec("a", "fa"), rec("calibration", "c", [1.0], kind="calibration")], [rec("a", "fa")],
                    CompareOptions(normalize="calibration"), base_label="runs/old", cand_label="runs/new")
    with pytest.raises(UsageError, match="^runs/old: no calibration record"):
        cmp.compare([rec("a", "fa")], [rec("a", "fa")], CompareOptions(normalize="calibration"),
                    base_label="runs/old", cand_label="runs/new")


def test_latest_record_of_a_cell_wins() -> None:
    base = [rec("a", "fa", [0.5] * 5)]
    cand = [rec("a", "fa", status="crashed", error="boom"), rec("a", "fa", [0.5] * 5)]
    assert cmp.compare(base, cand, OPTS)["verdict"].tolist() == ["PASS"]


# ---------------------------------------------------------------- presentation


def _cells(table: str) -> list[list[str]]:
    lines = table.splitlines()
    assert set(lines[1].replace("|", "").strip()) <= {"-", ":", " "}  # the github separator row
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in [lines[0], *lines[2:]]]


def test_format_table_exact_cells() -> None:
    base, cand = _scenario()
    df = cmp.compare(base, cand, OPTS)
    cells = _cells(cmp.format_table(df))
    assert cells[0] == ["cell", "verdict", "base median tok/s", "cand median tok/s", "ratio cand/base",
                        "95% CI ratio", "MWU p", "n base/cand", "reason"]
    p = float(mannwhitneyu([2500.0] * 5, [2000.0] * 5, alternative="less").pvalue)
    assert cells[1] == ["a", "IMPROVED", "2,000.0", "2,500.0", "1.250", "[1.250, 1.250]", format(p, ".2g"), "5/5",
                        "faster by 25.0% (CI [1.250, 1.250])"]
    assert cells[2] == ["b", "SKIPPED", "n/a", "n/a", "n/a", "n/a", "n/a", "0/0", "oom on both sides: CUDA out of memory"]
    assert cells[7] == ["i", "TOO FEW SAMPLES", "2,000.0", "2,000.0", "n/a", "n/a", "n/a", "5/4",
                        "5 base and 4 cand samples, need >= 5 per side; rerun with more measured steps"]
    assert [c[0] for c in cells[1:]] == ["a", "b", "c", "d", "g", "h", "i", "e"]
    big = df.copy()
    big.loc[0, "base_median_tok_per_s"] = 1234567.891
    big.loc[0, "p_value"] = 1.23e-5
    big.attrs["throughput_unit"] = "x calibration"
    cells = _cells(cmp.format_table(big))
    assert cells[0][2:4] == ["base median x calibration", "cand median x calibration"]
    assert cells[1][2] == "1,234,567.9" and cells[1][6] == "1.2e-05"
    big.attrs = {}  # a frame not made by compare(): tokens per second
    assert _cells(cmp.format_table(big))[0][2:4] == ["base median tok/s", "cand median tok/s"]


def test_verdict_summary_counts_and_exit() -> None:
    base, cand = _scenario()
    df = cmp.compare(base, cand, OPTS)
    line = cmp.verdict_summary(df)
    assert line.startswith("verdicts: ") and line.endswith("; exit 1")
    counts = dict(part.split(" ", 1)[::-1] for part in line[len("verdicts: "):-len("; exit 1")].split(", "))
    assert counts == {"MISSING": "2", "NOT COMPARABLE": "2", "IMPROVED": "1", "SKIPPED": "1", "REGRESSION": "1",
                      "TOO FEW SAMPLES": "1"}
    assert line.index("2 MISSING") < line.index("1 IMPROVED")  # most frequent first
    inconclusive = df.iloc[:1].copy()
    inconclusive.loc[0, "verdict"] = "INCONCLUSIVE"
    assert cmp.verdict_summary(inconclusive) == (
        "verdicts: 1 INCONCLUSIVE; 1 INCONCLUSIVE: a change beyond the threshold that the measurements cannot "
        "support (CI or MWU short of confidence, a side unstable, or its machine unsteady); each reason gives its "
        "remedy; exit 0")


def test_exit_codes() -> None:
    def code(*verdicts: str) -> int:
        return cmp.exit_code(pd.DataFrame({"verdict": list(verdicts)}))

    assert code("PASS", "IMPROVED", "INCONCLUSIVE", "SKIPPED") == 0
    for cannot in ("NOT COMPARABLE", "MISSING", "TOO FEW SAMPLES"):
        assert code("PASS", cannot) == 3, cannot
    assert code("MISSING", "REGRESSION") == 1


def test_run_compare_prints_table_and_summary_and_returns_the_code(tmp_path: Path) -> None:
    base, cand = _scenario()
    paths = []
    for name, records in (("base.jsonl", base), ("cand.jsonl", cand)):
        paths.append(tmp_path / name)
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in records))
    out, err = io.StringIO(), io.StringIO()
    assert cmp.run_compare(str(paths[0]), str(paths[1]), stdout=out, stderr=err) == 1
    text = out.getvalue().splitlines()
    assert text[0].startswith("| cell") and text[-1].startswith("verdicts: ") and text[-1].endswith("; exit 1")
    assert f"only in base; missing from {paths[1]}" in out.getvalue()
    assert f"only in cand; missing from {paths[0]}" in out.getvalue()
    assert err.getvalue() == ""
    # Options are validated before anything is read: a usage error is exit 2 with one line on stderr.
    out, err = io.StringIO(), io.StringIO()
    assert cmp.run_compare(str(paths[0]), str(paths[1]), threshold=1.5, stdout=out, stderr=err) == 2
    assert err.getvalue() == "harness compare: error: --threshold (1.5) must be in [0, 1); e.g. 0.05 for 5%\n"
    assert out.getvalue() == ""
    out, err = io.StringIO(), io.StringIO()
    assert cmp.run_compare(str(paths[0]), str(paths[1]), normalize="calibration", n_bootstrap=200, seed=3,
                           alpha=0.01, stdout=out, stderr=err) == 1
    assert "x calibration" in out.getvalue().splitlines()[0]


def test_short_is_the_first_line_cut_at_60() -> None:
    r = cmp._judge_pair(rec("a", "f", status="oom", error="a" * 61 + "\nsecond"),
                        rec("a", "f", status="oom"), OPTS, NONE)
    assert r.reason == "oom on both sides: no error message"
    r = cmp._judge_pair(rec("a", "f", status="invalid"), rec("a", "f", status="invalid", error="a" * 61 + "\nsecond"),
                        OPTS, NONE)
    assert r.reason == "invalid on both sides: " + "a" * 60
    r = cmp._judge_pair(rec("a", "f", status="oom", error="x\ny"), rec("a", "f", status="crashed"), OPTS, NONE)
    assert (r.verdict, r.reason) == ("NOT COMPARABLE", "base status oom: x; rerun the base cell")
    r = cmp._judge_pair(rec("a", "f"), rec("a", "f", status="crashed", error="x\ny"), OPTS, NONE)
    assert (r.verdict, r.reason) == ("REGRESSION", "cand status crashed (base ok): x")


def test_samples_are_scaled_before_judging() -> None:
    r = cmp._judge_pair(rec("a", "f", [0.5] * 5), rec("a", "f", [0.5] * 5), OPTS, (NO_NORMALISER, Normaliser(0.5)))
    assert (r.base_median, r.cand_median, r.ratio) == (2000.0, 1000.0, 0.5)
    assert np.isclose(r.ci_low, 0.5) and np.isclose(r.ci_high, 0.5)


def test_normaliser_spreads_widen_the_ci_by_both_factors_and_fill_the_row() -> None:
    """By hand: equal constant samples give ratio 1 and a bootstrap CI of [1, 1]; normalisers known within 10% and
    20% widen it by 1.1 x 1.2 = 1.32 to [1/1.32, 1.32], and the row says each side's spread in %."""
    base, cand = rec("a", "fa", [0.5] * 5), rec("a", "fa", [0.5] * 5)
    norms = (Normaliser(2.0, factor=1.1), Normaliser(2.0, factor=1.2))
    result = cmp._judge_pair(base, cand, OPTS, norms)
    assert (result.ci_low, result.ci_high) == (pytest.approx(1 / 1.32), pytest.approx(1.32))
    row = cmp._row("a", result, norms)
    assert (row["base_normaliser_spread_pct"], row["cand_normaliser_spread_pct"]) == (pytest.approx(10.0),
                                                                                      pytest.approx(20.0))
    plain = cmp._row("a", result)  # no normaliser: NaN, not None, in every normaliser column
    assert all(math.isnan(plain[k]) for k in ("base_normaliser_s", "cand_normaliser_s", "base_normaliser_spread_pct",
                                              "cand_normaliser_spread_pct"))


def test_a_spread_on_either_side_alone_shows_the_spread_column() -> None:
    base, cand = _scenario()
    df = cmp.compare(base, cand, OPTS)
    only_base = df.assign(base_normaliser_spread_pct=3.0)
    cells = _cells(cmp.format_table(only_base))
    assert cells[0][8] == "normaliser spread % base/cand" and cells[1][8] == "3.0/n/a"
    only_cand = df.assign(cand_normaliser_spread_pct=4.0)
    cells = _cells(cmp.format_table(only_cand))
    assert cells[0][8] == "normaliser spread % base/cand" and cells[1][8] == "n/a/4.0"

"""Unit tests of the regression gate (harness/compare/) and records loading."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from harness.cli import main
from harness.compare import stats
from harness.compare import verdicts as cmp
from harness.errors import UsageError
from harness.records.reader import load_benchmark_json, load_records

DATA = Path(__file__).parent / "data"
TOKENS_PER_STEP = 16 * 128


def make_record(
    cell_id: str = "tiny-ddp-fp32-w2-gb16-strong",
    step_times: list[float] | np.ndarray | None = None,
    precision: str = "fp32",
    status: str = "ok",
    kind: str = "cell",
    error: str | None = None,
    unstable_reason: str | None = None,
) -> dict[str, Any]:
    """A schema_version 1 record (docs/records.md) with its fingerprint computed from fields."""
    fields = {"workload": "tiny", "strategy": "ddp", "degrees": {"dp_replicate": 2, "tp": 1},
              "precision": precision, "global_batch": 16, "seq_len": 128, "world_size": 2,
              "device_name": "cpu", "torch": "2.13.0"}
    if kind == "calibration":
        fields = {"workload": "calibration"}
    fingerprint = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    times = [] if step_times is None else [float(t) for t in step_times]
    return {
        "schema_version": 1, "kind": kind, "run_id": "20261129-184500-ab12",
        "cell_id": "calibration" if kind == "calibration" else cell_id,
        "status": status, "error": error, "fingerprint": fingerprint,
        "fingerprint_fields": fields,
        "config": {"size": "tiny", "strategy": "ddp", "precision": precision, "world_size": 2,
                   "global_batch": 16, "seq_len": 128, "device_kind": "cpu"},
        "metrics": {"tokens_per_step": TOKENS_PER_STEP, "unstable": bool(unstable_reason),
                    "unstable_reason": unstable_reason},
        "samples": {"step_time_s": times},
    }


def noisy_times(median_s: float, seed: int, n: int = 20, cv: float = 0.03) -> np.ndarray:
    return median_s * (1.0 + cv * np.random.default_rng(seed).standard_normal(n))


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def table_verdicts(out: str) -> dict[str, str]:
    """cell -> verdict from the printed github table."""
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ")]
    return {r[1].strip(): r[2].strip() for r in rows[1:]}


def run(base: Path, cand: Path, **kwargs: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cmp.run_compare(str(base), str(cand), stdout=out, stderr=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------- pure statistics


def test_median_ratio_exact() -> None:
    base = np.array([1.0, 2.0, 3.0, 4.0, 50.0])  # median 3
    cand = np.array([2.0, 4.0, 6.0, 8.0, 10.0])  # median 6
    assert stats.median_ratio(base, cand) == 2.0


def test_mannwhitney_matches_scipy_directly() -> None:
    base = np.array([10.0, 11.0, 12.0, 13.0, 14.0, 15.0])
    cand = np.array([9.0, 10.5, 11.5, 12.5, 9.5, 8.0])
    expected = mannwhitneyu(cand, base, alternative="less").pvalue
    assert stats.mannwhitney_less_p(base, cand) == pytest.approx(expected, rel=1e-12)
    assert stats.mannwhitney_less_p(base, cand) < stats.mannwhitney_less_p(cand, base)


def test_bootstrap_ci_is_seeded_and_brackets_ratio() -> None:
    base, cand = noisy_times(100.0, 1), noisy_times(90.0, 2)
    ci = stats.bootstrap_ratio_ci(base, cand, n_resamples=1000, seed=0)
    assert ci == stats.bootstrap_ratio_ci(base, cand, n_resamples=1000, seed=0)
    assert ci != stats.bootstrap_ratio_ci(base, cand, n_resamples=1000, seed=1)
    assert ci[0] < stats.median_ratio(base, cand) < ci[1]
    constant = np.full(7, 5.0)
    assert stats.bootstrap_ratio_ci(constant, constant * 2, 200, 0) == (2.0, 2.0)


@pytest.mark.parametrize(
    ("ratio", "ci", "p", "verdict"),
    [
        (0.90, (0.85, 0.95), 0.001, stats.REGRESSION),
        (0.90, (0.80, 1.02), 0.001, stats.INCONCLUSIVE),
        (0.90, (0.85, 0.95), 0.20, stats.INCONCLUSIVE),
        (0.97, (0.95, 0.99), 0.001, stats.PASS),
        (0.97, (0.93, 0.99), 0.001, stats.INCONCLUSIVE),
        (1.10, (1.05, 1.15), 0.999, stats.IMPROVED),
        (1.10, (0.99, 1.15), 0.999, stats.PASS),
    ],
)
def test_decide_branches(ratio: float, ci: tuple[float, float], p: float, verdict: str) -> None:
    assert stats.decide(ratio, ci[0], ci[1], p, threshold=0.05, alpha=0.05)[0] == verdict


def test_inconclusive_reason_gives_remedy() -> None:
    _, reason = stats.decide(0.90, 0.80, 1.02, 0.001, threshold=0.05, alpha=0.05)
    assert reason == "slower by 10.0% but CI [0.800, 1.020] crosses 1; rerun with more steps"


def test_too_few_samples() -> None:
    result = stats.judge_samples(np.ones(4), np.ones(20), stats.CompareOptions())
    assert result.verdict == stats.TOO_FEW
    assert "4 base and 20 cand samples, need >= 5" in result.reason


def test_power_and_false_positive_rate() -> None:
    """Planted 10% slowdown at CV 3%, 20 samples: flagged in >= 95% of 200 seeds;
    no change: flagged in <= 1% of 200 seeds."""
    opts = stats.CompareOptions(n_bootstrap=500)
    flagged_slow = flagged_same = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        base = rng.normal(100.0, 3.0, 20)
        slow = rng.normal(90.0, 3.0, 20)
        same = rng.normal(100.0, 3.0, 20)
        flagged_slow += stats.judge_samples(base, slow, opts).verdict == stats.REGRESSION
        flagged_same += stats.judge_samples(base, same, opts).verdict == stats.REGRESSION
    assert flagged_slow >= 190, flagged_slow
    assert flagged_same <= 2, flagged_same


def test_throughput_samples_are_tokens_over_time() -> None:
    record = make_record(step_times=[0.5, 0.25])
    np.testing.assert_array_equal(cmp.throughput_samples(record),
                                  [TOKENS_PER_STEP / 0.5, TOKENS_PER_STEP / 0.25])


def test_fingerprint_diff_names_fields() -> None:
    a, b = make_record(precision="fp32"), make_record(precision="bf16")
    assert cmp.fingerprint_diff(a["fingerprint_fields"], b["fingerprint_fields"]) == (
        "precision differs (fp32 vs bf16)")


def test_options_validated() -> None:
    with pytest.raises(UsageError, match=r"--threshold \(1.5\) must be in \[0, 1\)"):
        stats.CompareOptions(threshold=1.5)


# ---------------------------------------------------------------- end to end on files


def test_pass_exit_0(tmp_path: Path) -> None:
    base = write_jsonl(tmp_path / "base.jsonl", [make_record(step_times=noisy_times(0.1, 1))])
    cand = write_jsonl(tmp_path / "cand.jsonl", [make_record(step_times=noisy_times(0.1, 2))])
    code, out, err = run(base, cand)
    assert (code, err) == (0, "")
    assert table_verdicts(out) == {"tiny-ddp-fp32-w2-gb16-strong": "PASS"}


def test_regression_exit_1(tmp_path: Path) -> None:
    base = write_jsonl(tmp_path / "base.jsonl", [make_record(step_times=noisy_times(0.1, 1))])
    cand = write_jsonl(tmp_path / "cand.jsonl", [make_record(step_times=noisy_times(0.12, 2))])
    code, out, _ = run(tmp_path / "base.jsonl", cand)
    assert code == 1
    assert "REGRESSION" in out and "slower by" in out
    df = cmp.compare(load_records(base), load_records(cand), stats.CompareOptions())
    assert df.loc[0, "ratio"] == pytest.approx(
        np.median(TOKENS_PER_STEP / noisy_times(0.12, 2))
        / np.median(TOKENS_PER_STEP / noisy_times(0.1, 1)))
    assert df.loc[0, "ci_high"] < 1.0


def test_run_directory_input(tmp_path: Path) -> None:
    for side, seed in (("base", 1), ("cand", 2)):
        (tmp_path / side).mkdir()
        write_jsonl(tmp_path / side / "records.jsonl",
                    [make_record(step_times=noisy_times(0.1, seed))])
    assert run(tmp_path / "base", tmp_path / "cand")[0] == 0


def test_precision_mismatch_not_comparable_exit_3(tmp_path: Path) -> None:
    base = write_jsonl(tmp_path / "b.jsonl", [make_record(step_times=noisy_times(0.1, 1))])
    cand = write_jsonl(tmp_path / "c.jsonl",
                       [make_record(step_times=noisy_times(0.1, 2), precision="bf16")])
    code, out, _ = run(base, cand)
    assert code == 3
    assert "NOT COMPARABLE" in out
    assert "not comparable: precision differs (fp32 vs bf16)" in out


def test_missing_cell_exit_3_and_regression_wins(tmp_path: Path) -> None:
    slow = make_record(step_times=noisy_times(0.12, 2))
    extra = make_record(cell_id="other", step_times=noisy_times(0.1, 3))
    extra["fingerprint"] = "ffffffffffffffff"
    base = write_jsonl(tmp_path / "b.jsonl", [make_record(step_times=noisy_times(0.1, 1)), extra])
    only_missing = write_jsonl(tmp_path / "c1.jsonl", [make_record(step_times=noisy_times(0.1, 2))])
    code, out, _ = run(base, only_missing)
    assert code == 3
    assert table_verdicts(out)["other"] == "MISSING" and "only in base" in out
    with_regression = write_jsonl(tmp_path / "c2.jsonl", [slow])
    assert run(base, with_regression)[0] == 1


def test_torn_last_line_is_reported_and_the_complete_records_compared(tmp_path: Path) -> None:
    good = json.dumps(make_record(step_times=noisy_times(0.1, 1)))
    truncated = tmp_path / "cand.jsonl"
    truncated.write_text(good + "\n" + good[: len(good) // 2])
    base = write_jsonl(tmp_path / "base.jsonl", [make_record(step_times=noisy_times(0.1, 1))])
    code, out, err = run(base, truncated)
    assert code == 0 and "PASS" in out
    assert err.count("\n") == 1
    assert f"{truncated}: line 2 is a torn write (an interrupted append) and is ignored" in err


def test_corrupt_or_foreign_files_exit_2_naming_the_line(tmp_path: Path) -> None:
    good = json.dumps(make_record(step_times=noisy_times(0.1, 1)))
    base = write_jsonl(tmp_path / "base.jsonl", [make_record(step_times=noisy_times(0.1, 1))])
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text(good + "\n{oops\n" + good + "\n")
    code, out, err = run(base, corrupt)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert f"{corrupt}: line 2 is not valid JSON" in err and "corrupt at that line" in err
    foreign = tmp_path / "notes.txt"
    foreign.write_text("these are my notes\nnot records\n")
    code, out, err = run(base, foreign)
    assert (code, out) == (2, "") and "not a records file" in err and "interrupted" not in err


def test_nonexistent_file_exit_2(tmp_path: Path) -> None:
    code, _, err = run(tmp_path / "nope.jsonl", tmp_path / "nope.jsonl")
    assert code == 2
    assert f"{tmp_path / 'nope.jsonl'}: no such records file" in err


def test_failed_cand_cell_is_regression_and_unstable_is_reported(tmp_path: Path) -> None:
    base = write_jsonl(tmp_path / "b.jsonl", [make_record(
        step_times=noisy_times(0.1, 1), unstable_reason="unstable: CV 14% > 10%, rerun with more steps")])
    cand = write_jsonl(tmp_path / "c.jsonl", [make_record(status="oom", error="CUDA out of memory")])
    code, out, _ = run(base, cand)
    assert code == 1
    assert "cand status oom (base ok): CUDA out of memory" in out
    cand_ok = write_jsonl(tmp_path / "c2.jsonl", [make_record(step_times=noisy_times(0.1, 2))])
    assert "base unstable: CV 14% > 10%, rerun with more steps" in run(base, cand_ok)[1]


def test_same_invalid_or_oom_on_both_sides_is_skipped(tmp_path: Path) -> None:
    ok = make_record(step_times=noisy_times(0.1, 1))
    invalid = make_record(cell_id="bad", status="invalid", error="tp (3) must divide n_heads (8)")
    invalid["fingerprint"] = "eeeeeeeeeeeeeeee"
    base = write_jsonl(tmp_path / "b.jsonl", [ok, invalid])
    cand = write_jsonl(tmp_path / "c.jsonl", [make_record(step_times=noisy_times(0.1, 2)), invalid])
    code, out, _ = run(base, cand)
    assert code == 0
    assert table_verdicts(out) == {"tiny-ddp-fp32-w2-gb16-strong": "PASS", "bad": "SKIPPED"}
    crashed = {**ok, "status": "crashed", "error": "segfault", "samples": {}}
    code, out, _ = run(base, write_jsonl(tmp_path / "c2.jsonl", [crashed, invalid]))
    assert code == 1 and "cand status crashed (base ok): segfault" in out
    oom_only_in_base = {**invalid, "status": "oom"}
    code, out, _ = run(write_jsonl(tmp_path / "b2.jsonl", [ok, oom_only_in_base]), cand)
    assert code == 3 and "base status oom: tp (3) must divide" in out


def test_too_few_samples_exit_3(tmp_path: Path) -> None:
    base = write_jsonl(tmp_path / "b.jsonl", [make_record(step_times=[0.1, 0.1, 0.1])])
    cand = write_jsonl(tmp_path / "c.jsonl", [make_record(step_times=noisy_times(0.1, 2))])
    code, out, _ = run(base, cand)
    assert code == 3 and "TOO FEW SAMPLES" in out


def test_inconclusive_exit_0_printed(tmp_path: Path) -> None:
    times = np.array([0.05, 0.08, 0.10, 0.12, 0.20, 0.30])  # very noisy: CV ~ 60%
    base = write_jsonl(tmp_path / "b.jsonl", [make_record(step_times=times)])
    cand = write_jsonl(tmp_path / "c.jsonl", [make_record(step_times=times[::-1] * 1.1)])
    code, out, _ = run(base, cand)
    assert code == 0
    assert table_verdicts(out) == {"tiny-ddp-fp32-w2-gb16-strong": "INCONCLUSIVE"}
    assert "slower by 9.1% but CI" in out and "1 INCONCLUSIVE: a change beyond the threshold" in out


def test_calibration_normalization_cancels_slower_machine(tmp_path: Path) -> None:
    def side(name: str, slowdown: float, seed: int, calibrated: bool = True) -> Path:
        records = [make_record(step_times=noisy_times(0.1 * slowdown, seed))]
        if calibrated:
            records.insert(0, make_record(kind="calibration",
                                          step_times=noisy_times(0.05 * slowdown, seed + 10)))
        return write_jsonl(tmp_path / f"{name}.jsonl", records)

    base, cand = side("base", 1.0, 1), side("cand", 1.25, 2)
    assert run(base, cand)[0] == 1
    code, out, _ = run(base, cand, normalize="calibration")
    assert code == 0 and "base median x calibration" in out
    code, _, err = run(base, side("uncal", 1.0, 3, calibrated=False), normalize="calibration")
    assert code == 2
    assert "no calibration record" in err and "use --normalize none" in err


def test_cli_compare_parses_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write_jsonl(tmp_path / "b.jsonl", [make_record(step_times=noisy_times(0.1, 1))])
    cand = write_jsonl(tmp_path / "c.jsonl", [make_record(step_times=noisy_times(0.106, 2))])
    assert main(["compare", str(base), str(cand), "--threshold", "0.01", "--seed", "3",
                 "--bootstrap", "500"]) == 1
    assert main(["compare", str(base), str(cand), "--threshold", "0.2"]) == 0
    assert "verdicts:" in capsys.readouterr().out


# ---------------------------------------------------------------- pytest-benchmark JSON


def test_benchmark_json_parsed() -> None:
    records = load_benchmark_json(DATA / "compare_pytest_benchmark_base.json")
    assert [r["cell_id"] for r in records] == [
        "tests/bench/test_step.py::test_step[tiny]", "tests/bench/test_step.py::test_step[small]",
        "tests/bench/test_step.py::test_step_extra"]
    assert len(records[0]["samples"]["step_time_s"]) == 12  # from stats.data
    assert len(records[2]["samples"]["step_time_s"]) == 12  # extra_info wins over 3 stats.data
    assert records[0]["fingerprint_fields"]["cpu"] == "AMD EPYC"
    assert records[2]["fingerprint_fields"]["fingerprint"] == "fp-extra"


def test_benchmark_json_compared() -> None:
    code, out, _ = run(DATA / "compare_pytest_benchmark_base.json",
                       DATA / "compare_pytest_benchmark_cand.json")
    assert code == 1
    assert table_verdicts(out) == {"tests/bench/test_step.py::test_step[tiny]": "PASS",
                        "tests/bench/test_step.py::test_step[small]": "REGRESSION",
                        "tests/bench/test_step.py::test_step_extra": "PASS"}


def test_benchmark_json_truncated_and_without_samples(tmp_path: Path) -> None:
    text = (DATA / "compare_pytest_benchmark_base.json").read_text()
    truncated = tmp_path / "t.json"
    truncated.write_text(text[:200])
    code, _, err = run(truncated, DATA / "compare_pytest_benchmark_cand.json")
    assert code == 2 and str(truncated) in err and "regenerate it with pytest" in err
    doc = json.loads(text)
    for bench in doc["benchmarks"]:
        bench["stats"].pop("data")
        bench["extra_info"].pop("step_time_s", None)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(doc))
    code, out, _ = run(bare, bare)
    assert code == 3 and set(table_verdicts(out).values()) == {"TOO FEW SAMPLES"}

"""``harness compare --normalize calibration`` never invents a change (issue 29).

The reported case: a base measured beside a CPU hog, its one calibration median far off, and an
unchanged rerun judged "IMPROVED, faster by 3165.6%" in the row whose reason said both sides were
unstable. Each scenario here is built from records, and where it reproduces that failure the
test first shows that the numbers alone (the old single-median normaliser, nothing withheld)
call a change, so the assertion after it can fail.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.compare import stats
from harness.compare import verdicts as cmp
from harness.compare.cell_normaliser import (
    SPREAD_LIMIT,
    Normaliser,
    cell_normaliser,
    run_normaliser,
    spread_of,
)
from harness.compare.stats import CompareOptions
from harness.errors import UsageError

TOKENS = 2048
CALIBRATED = CompareOptions(normalize="calibration", threshold=0.25)
NONE = CompareOptions(threshold=0.25)
UNSTABLE = "unstable: CV 102% > 10%, rerun with more steps"


def cell(i: int, times: np.ndarray, probes: tuple[float, float] | None = None,
         unstable: str | None = None, status: str = "ok") -> dict[str, Any]:
    metrics: dict[str, Any] = {"tokens_per_step": TOKENS, "unstable": bool(unstable), "unstable_reason": unstable}
    if probes is not None:
        metrics["machine_probe_s"] = {"before": probes[0], "after": probes[1]}
    return {"schema_version": 1, "config": {}, "kind": "cell", "cell_id": f"cell{i}", "status": status, "error": None if status == "ok" else "boom",
            "fingerprint": f"fp{i}", "fingerprint_fields": {"cell": i}, "metrics": metrics,
            "samples": {"step_time_s": [float(t) for t in times]}}


def calibration(times: np.ndarray) -> dict[str, Any]:
    return {"schema_version": 1, "config": {}, "kind": "calibration", "cell_id": "calibration", "status": "ok", "fingerprint": "cal",
            "metrics": {"tokens_per_step": 1}, "samples": {"step_time_s": [float(t) for t in times]}}


def steady(median: float, seed: int, n: int = 20, cv: float = 0.03) -> np.ndarray:
    return median * (1.0 + cv * np.random.default_rng(seed).standard_normal(n))


def disturbed(median: float, seed: int, n: int = 20) -> np.ndarray:
    """Step times beside a hog: lognormal with CV ~100%."""
    return median * np.random.default_rng(seed).lognormal(0.0, 0.83, n)


def hogged(median: float, seed: int, n: int) -> np.ndarray:
    """Matmul timings beside a hog: anywhere from 0.4x to 1.6x ``median`` (0.012-0.048 s at 0.03)."""
    return median * np.random.default_rng(seed).uniform(0.4, 1.6, n)


def quiet_run(step_s: float, seed: int, cells: int = 2, unstable: str | None = None) -> list[dict[str, Any]]:
    probes = steady(0.001, seed + 100, 2 * cells, cv=0.01)
    return [calibration(steady(0.001, seed + 200, 15, cv=0.02))] + [
        cell(i, steady(step_s, seed + i), (probes[2 * i], probes[2 * i + 1]), unstable) for i in range(cells)]


def noisy_run(step_s: float, seed: int, cells: int = 2, unstable: str | None = UNSTABLE,
              flagged_steps: bool = True, matmul_s: float = 0.03) -> list[dict[str, Any]]:
    """A run beside a CPU hog: matmul timings (30x a quiet run's by default) all over the place."""
    probes = hogged(matmul_s, seed + 100, 2 * cells)
    times = disturbed if flagged_steps else steady
    return [calibration(hogged(matmul_s, seed + 200, 15))] + [
        cell(i, times(step_s, seed + i), (probes[2 * i], probes[2 * i + 1]), unstable) for i in range(cells)]


def old_verdicts(base: list[dict], cand: list[dict], opts: CompareOptions) -> set[str]:
    """What the gate said before: one calibration median per side, nothing withheld."""
    def scale(records: list[dict]) -> float:
        if opts.normalize == "none":
            return 1.0
        return float(np.median(next(r for r in records if r["kind"] == "calibration")["samples"]["step_time_s"]))

    pairs = zip((r for r in base if r["kind"] == "cell"), (r for r in cand if r["kind"] == "cell"))
    return {stats.judge_samples(cmp.throughput_samples(b) * scale(base),
                                cmp.throughput_samples(c) * scale(cand), opts).verdict for b, c in pairs}


def verdicts(df) -> set[str]:
    return set(df["verdict"])


# ---------------------------------------------------------------- the reported case


@pytest.mark.parametrize("disturbed_side", ["base", "cand"])
def test_one_side_beside_a_hog_gives_no_change(disturbed_side: str) -> None:
    noisy, quiet = noisy_run(0.3, 1), quiet_run(0.1, 2)
    base, cand = (noisy, quiet) if disturbed_side == "base" else (quiet, noisy)
    invented = stats.REGRESSION if disturbed_side == "base" else stats.IMPROVED
    assert old_verdicts(base, cand, CALIBRATED) == {invented}  # the failure this guards against
    df = cmp.compare(base, cand, CALIBRATED)
    assert verdicts(df) <= {stats.PASS, stats.INCONCLUSIVE} and cmp.exit_code(df) == 0
    for reason in df["reason"]:
        assert f" but {disturbed_side} {UNSTABLE}; {disturbed_side} normaliser spread " in reason
        assert "machine not steady (limit 10%); rerun on a quiet machine" in reason
    assert (df[f"{disturbed_side}_normaliser_spread_pct"] > 50).all()
    other = "cand" if disturbed_side == "base" else "base"
    assert (df[f"{other}_normaliser_spread_pct"] < 5).all()


@pytest.mark.parametrize("disturbed_side", ["base", "cand"])
def test_a_flagged_unstable_side_gives_no_change_without_normalising(disturbed_side: str) -> None:
    noisy, quiet = noisy_run(0.3, 3), quiet_run(0.1, 4)
    base, cand = (noisy, quiet) if disturbed_side == "base" else (quiet, noisy)
    # unnormalised, the hogged side is simply slower
    assert old_verdicts(base, cand, NONE) == {stats.IMPROVED if disturbed_side == "base" else stats.REGRESSION}
    df = cmp.compare(base, cand, NONE)
    assert verdicts(df) == {stats.INCONCLUSIVE}
    assert all(r.endswith(f" but {disturbed_side} {UNSTABLE}") for r in df["reason"])
    assert "normaliser" not in " ".join(df["reason"])  # --normalize none: no normaliser to speak of


def test_an_unsteady_normaliser_alone_gives_no_change() -> None:
    base = noisy_run(0.2, 5, unstable=None, flagged_steps=False)  # steady steps, hogged matmul timings
    cand = quiet_run(0.1, 6)
    assert old_verdicts(base, cand, CALIBRATED) == {stats.REGRESSION}
    df = cmp.compare(base, cand, CALIBRATED)
    assert verdicts(df) == {stats.INCONCLUSIVE}
    spread = run_normaliser(base, "base")
    assert spread.spread > SPREAD_LIMIT
    for r in df.itertuples():
        note = cell_normaliser(next(c for c in base if c["cell_id"] == r.cell_id), spread).unsteady_note("base")
        assert r.reason.endswith(f" but {note}") and "unstable" not in r.reason


def test_both_sides_beside_a_hog_give_no_change() -> None:
    base, cand = noisy_run(0.3, 7), noisy_run(0.3, 8, matmul_s=0.01)  # same code, hogs of another weight
    assert old_verdicts(base, cand, CALIBRATED) == {stats.REGRESSION}
    for opts in (CALIBRATED, NONE):
        df = cmp.compare(base, cand, opts)
        assert verdicts(df) <= {stats.PASS, stats.INCONCLUSIVE}, opts
        assert all("base unstable" in r and "cand unstable" in r for r in df["reason"])


def test_a_cell_failing_only_in_the_candidate_stays_a_regression_beside_a_hog() -> None:
    base = noisy_run(0.3, 9)
    cand = quiet_run(0.1, 10)
    cand[1] = {**cand[1], "status": "crashed", "error": "segfault", "samples": {}}
    df = cmp.compare(base, cand, CALIBRATED)
    assert df.loc[df["cell_id"] == "cell0", ["verdict", "reason"]].values.tolist() == [
        ["REGRESSION", "cand status crashed (base ok): segfault"]]
    assert cmp.exit_code(df) == 1


# ---------------------------------------------------------------- the gate keeps its power


def test_a_real_slowdown_on_steady_machines_is_a_regression_and_an_identical_pair_passes() -> None:
    base, cand = quiet_run(0.1, 11), quiet_run(0.2, 12)
    df = cmp.compare(base, cand, CALIBRATED)
    assert verdicts(df) == {stats.REGRESSION} and cmp.exit_code(df) == 1
    assert (df["ci_high"] < 0.6).all() and all(r.startswith("slower by ") for r in df["reason"])
    slower = cmp.compare(base, quiet_run(0.1 / 0.7, 12), CALIBRATED)  # 30% slower against a 25% threshold
    assert verdicts(slower) == {stats.REGRESSION}
    same = cmp.compare(base, json.loads(json.dumps(base)), CALIBRATED)
    assert verdicts(same) == {stats.PASS} and (same["ratio"] == 1.0).all()


def test_a_machine_that_slowed_mid_run_is_normalised_per_cell() -> None:
    """The candidate's machine ran at half speed from cell 3 on; its probes say so, its cells took twice as long."""
    base = quiet_run(0.1, 13, cells=6)
    cand = [calibration(steady(0.001, 14, 15, cv=0.02))] + [
        cell(i, steady(0.1 * (1 if i < 3 else 2), 20 + i), (0.001, 0.001) if i < 3 else (0.002, 0.002))
        for i in range(6)]
    assert old_verdicts(base, cand, CALIBRATED) == {stats.PASS, stats.REGRESSION}  # the run median cannot see it
    df = cmp.compare(base, cand, CALIBRATED)
    # never a REGRESSION; not a PASS either: the candidate's normaliser spread (100%) widens every CI past
    # the 25% threshold, so a slowdown beyond it is not ruled out, and the reason says why
    assert verdicts(df) == {stats.INCONCLUSIVE}, df[["cell_id", "verdict", "reason"]].values.tolist()
    assert all("reaches below 0.750" in r and "machine not steady" in r for r in df["reason"])
    assert df["cand_normaliser_s"].tolist() == [0.001] * 3 + [0.002] * 3
    assert (df["ratio"].between(0.95, 1.05)).all()


# ---------------------------------------------------------------- exact pieces


def test_spread_and_cell_normaliser_exact() -> None:
    run = spread_of([1.0] * 8 + [2.0, 4.0])  # median 1, p90 = 2 + 0.1 * 2
    assert (run.time_s, run.factor, run.evidence) == (1.0, pytest.approx(2.2), "matmul 1-2.2 s, p10-p90 of 10 timings")
    assert run.unsteady_note("base") == (
        "base normaliser spread 120% (matmul 1-2.2 s, p10-p90 of 10 timings): machine not steady (limit 10%); "
        "rerun on a quiet machine")
    assert cell_normaliser(cell(0, [0.1]), run) == run  # no probes: the run's
    assert cell_normaliser(cell(0, [0.1], (1.0, 1.5)), run) == Normaliser(1.25, run.factor, run.evidence)
    wide = cell_normaliser(cell(0, [0.1], (1.0, 4.0)), run)
    assert (wide.time_s, wide.factor, wide.evidence) == (2.5, 2.5, "probes around the cell 1-4 s")
    one = cell(0, [0.1])
    one["metrics"]["machine_probe_s"] = {"before": 3.0, "after": None}  # a probe that did not run
    assert cell_normaliser(one, spread_of([3.0])) == Normaliser(3.0, 1.0, "matmul 3-3 s, p10-p90 of 1 timings")
    assert Normaliser(1.0, 1.0 + SPREAD_LIMIT).unsteady_note("cand") is None  # at the limit: steady


def test_probes_alone_normalise_and_corrupt_probes_are_refused() -> None:
    records = [cell(0, [0.1], (2.0, 4.0)), cell(1, [0.1])]
    assert run_normaliser(records, "base").time_s == 3.0
    with pytest.raises(UsageError) as e:
        run_normaliser([cell(0, [0.1], (2.0, -1.0))], "base")
    assert str(e.value) == ("cell 'cell0': metrics.machine_probe_s.after (-1.0) must be a finite number > 0; "
                            "the record is corrupt, rerun the cell")


def test_normaliser_spread_widens_the_ci_multiplicatively() -> None:
    base, cand = np.full(5, 100.0), np.full(5, 80.0)
    plain = stats.judge_samples(base, cand, CompareOptions())
    assert (plain.verdict, plain.ci_low, plain.ci_high) == ("REGRESSION", 0.8, 0.8)
    wide = stats.judge_samples(base, cand, CompareOptions(), ci_factor=1.1 * 1.2)
    assert (wide.ci_low, wide.ci_high) == (pytest.approx(0.8 / 1.32), pytest.approx(0.8 * 1.32))
    assert wide.verdict == "INCONCLUSIVE" and "crosses 1" in wide.reason
    with pytest.raises(UsageError, match=r"^ci_factor \(0.9\) must be >= 1"):
        stats.judge_samples(base, cand, CompareOptions(), ci_factor=0.9)


def test_withhold_change_exact() -> None:
    change = stats.PairResult("IMPROVED", "faster by 3165.6% (CI [1.2, 90.0])")
    held = stats.withhold_change(change, ["base unstable: CV 102% > 10%", "base normaliser spread 85% (x)"])
    assert (held.verdict, held.reason) == (
        "INCONCLUSIVE", "faster by 3165.6% (CI [1.2, 90.0]) but base unstable: CV 102% > 10%; "
                        "base normaliser spread 85% (x)")
    kept = stats.withhold_change(stats.PairResult("PASS", "within +/-5%"), ["cand unstable"])
    assert (kept.verdict, kept.reason) == ("PASS", "within +/-5%; cand unstable")
    assert stats.withhold_change(change, []) is change


def test_table_shows_the_normaliser_spread_and_a_bare_run_is_exit_2(tmp_path: Path) -> None:
    paths = {}
    for name, records in (("base", noisy_run(0.3, 15)), ("cand", quiet_run(0.1, 16)),
                          ("bare", [cell(0, steady(0.1, 17)), cell(1, steady(0.1, 18))])):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    out, err = io.StringIO(), io.StringIO()
    assert cmp.run_compare(str(paths["base"]), str(paths["cand"]), threshold=0.25, normalize="calibration",
                           stdout=out, stderr=err) == 0
    header = [c.strip() for c in out.getvalue().splitlines()[0].strip("|").split("|")]
    assert header[8] == "normaliser spread % base/cand"
    df = cmp.compare(json.loads(json.dumps(noisy_run(0.3, 15))), quiet_run(0.1, 16), CALIBRATED)
    row = [c.strip() for c in out.getvalue().splitlines()[2].strip("|").split("|")]
    assert row[8] == f"{df['base_normaliser_spread_pct'][0]:.1f}/{df['cand_normaliser_spread_pct'][0]:.1f}"
    assert "INCONCLUSIVE: a change beyond the threshold that the measurements cannot support" in out.getvalue()
    out, err = io.StringIO(), io.StringIO()
    assert cmp.run_compare(str(paths["bare"]), str(paths["cand"]), normalize="calibration",
                           stdout=out, stderr=err) == 2
    assert err.getvalue().startswith(f"harness compare: error: {paths['bare']}: no calibration record")
    assert "use --normalize none" in err.getvalue()

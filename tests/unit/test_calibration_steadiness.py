"""A calibration knows when it was measured badly (issue 29): its repeats' spread is judged and stored,
an unsteady entry is measured again rather than reused, and a cell the model missed by 20x names it."""

from __future__ import annotations

import io
import time

import pytest

from harness.calibration import auto, matmul, provenance, steadiness, store, workload
from harness.cli import main
from harness.planner import expand
from harness.spec import SweepSpec
from workloads.sizes import get_size

PARAMS = 1_000_000


def _repeats(scale: float = 1.0, outlier: tuple[str, float] | None = None) -> dict[str, list[float]]:
    """Steady repeats of every workload probe (within 1.1x), times ``scale``; ``outlier``: one repeat of
    one probe multiplied by a factor."""
    base = {workload.pass_probe(r): 0.02 + 0.01 * r for r in workload.PROBE_ROWS}
    base[workload.optimizer_probe()] = 0.009
    for w in workload.WRAPPERS:
        base[workload.pass_probe(1, w)] = 0.035
        base[workload.optimizer_probe(w)] = 0.012
    jitter = (1.0, 1.05, 0.98, 1.02, 1.08)
    out = {name: [t * scale * j for j in jitter] for name, t in base.items()}
    if outlier:
        name, factor = outlier
        out[name][0] *= factor
    return out


def _entry(repeats: dict[str, list[float]]) -> dict:
    """What ``measure_concurrent`` returns for these repeats."""
    return {"size": "tiny", "seq_len": 128, "dtype": "fp32", "rows": list(workload.PROBE_ROWS), "params": PARAMS,
            "base_gib": 0.4, **workload.from_repeats(repeats, PARAMS)}


# ---------------------------------------------------------------- the spread check, pure


def test_stats_and_summary_are_exact():
    assert steadiness.stats([0.04, 0.02, 0.03]) == {"n": 3, "median": 0.03, "min": 0.02, "max": 0.04, "spread": 2.0}
    assert steadiness.summary({"a": [1.0, 1.1], "b": [1.0, 3.0, 2.0]}) == {
        "probe": "b", "n": 3, "min_s": 1.0, "max_s": 3.0, "ratio": 3.0, "limit": steadiness.MAX_SPREAD}
    assert steadiness.summary({}) is None
    with pytest.raises(ValueError, match="a probe needs at least one repeat"):
        steadiness.stats([])


def test_consistent_repeats_are_accepted():
    reps = _repeats()
    assert steadiness.judge(reps) is None
    assert workload.judge_entry(_entry(reps)) is None
    assert steadiness.summary(reps)["ratio"] == pytest.approx(1.08 / 0.98)


def test_one_10x_outlier_is_unsteady_and_named():
    reps = _repeats(outlier=(workload.pass_probe(1), 10.0))
    why = workload.judge_entry(_entry(reps))
    assert why == "pass 1 row repeats spread 10x over 5 (0.0294-0.3 s) > 2x"


def test_a_pass_at_more_rows_cannot_be_much_faster():
    """Evenly slow repeats of one probe pass the spread check; the order of the probes catches them:
    the issue's 330 ms one-row pass beside a quiet 8-row pass of 100 ms."""
    reps = _repeats()
    reps[workload.pass_probe(1)] = [0.33, 0.331, 0.332, 0.333, 0.334]
    why = workload.judge_entry(_entry(reps))
    assert why is not None and why == "pass 2 rows (0.0408 s) measured 8.1x faster than pass 1 row (0.332 s), which it cannot be"


def test_a_wrapped_adamw_step_cannot_be_much_faster_than_the_plain_one():
    reps = _repeats()
    reps[workload.optimizer_probe()] = [0.89] * 5  # the AdamW step, evenly slow
    why = workload.judge_entry(_entry(reps))
    assert why is not None and why.startswith("fsdp AdamW step (0.0122 s) measured 73x faster than AdamW step")


class _Measure:
    """An injected measurement: returns the given entries in turn and counts the calls."""

    def __init__(self, *entries: dict) -> None:
        self.entries, self.calls = list(entries), 0

    def __call__(self) -> dict:
        self.calls += 1
        return self.entries.pop(0)


def test_steady_first_measurement_is_taken_once():
    m, err = _Measure(_entry(_repeats())), io.StringIO()
    e = steadiness.measure_steadily(m, "workload tiny", workload.judge_entry, err=err)
    assert m.calls == 1 and e["attempts"] == 1 and e["unsteady"] is False and err.getvalue() == ""
    assert e["spread"]["probe"] and e["spread"]["n"] == 5 and e["spread"]["ratio"] < steadiness.MAX_SPREAD


def test_an_outlier_triggers_one_more_measurement():
    m, err = _Measure(_entry(_repeats(outlier=(workload.optimizer_probe(), 10.0))), _entry(_repeats())), io.StringIO()
    e = steadiness.measure_steadily(m, "workload tiny", workload.judge_entry, err=err)
    assert m.calls == 2 and e["attempts"] == 2 and e["unsteady"] is False
    assert err.getvalue() == ("calibration: workload tiny: AdamW step repeats spread 10x over 5 (0.00882-0.09 s) "
                              "> 2x, machine not steady; measuring again\n")


def test_twice_unsteady_is_stored_marked_and_the_faster_attempt_kept():
    slow = _entry(_repeats(scale=3.0, outlier=(workload.pass_probe(8), 10.0)))
    fast = _entry(_repeats(outlier=(workload.pass_probe(4), 4.0)))
    m, err = _Measure(slow, fast), io.StringIO()
    e = steadiness.measure_steadily(m, "workload tiny", workload.judge_entry, err=err)
    assert m.calls == steadiness.ATTEMPTS == 2
    assert e["unsteady"] is True and e["pass_s"] == fast["pass_s"]
    assert e["unsteady_reason"] == "pass 4 rows repeats spread 4.1x over 5 (0.0588-0.24 s) > 2x"
    lines = err.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith("measuring again")
    assert lines[1].startswith("calibration: workload tiny: still unsteady (pass 4 rows repeats spread 4.1x")
    assert "predictions from it are flagged" in lines[1]


def test_why_remeasure():
    assert steadiness.why_remeasure(None) == "not measured yet"
    assert steadiness.why_remeasure({"alpha_s": 1.0}).startswith("stored entry has no record of its repeats' spread")
    assert steadiness.why_remeasure({"spread": {"ratio": 3.0}, "unsteady": True, "unsteady_reason": "x"}) == \
        "stored entry is marked unsteady (x)"
    assert steadiness.why_remeasure({"spread": {"ratio": 1.1}, "unsteady": False}) is None


def test_calibrate_workload_measures_again_and_stores_the_repeats(tmp_path, monkeypatch, capsys):
    """The real path: ``calibrate_workload`` with the K copies replaced by injected measurements."""
    m = _Measure(_entry(_repeats(outlier=(workload.pass_probe(1), 10.0))), _entry(_repeats()))
    monkeypatch.setattr(workload, "measure_concurrent", lambda *a: m())
    monkeypatch.setattr(workload, "check_fits", lambda *a: None)
    e = workload.calibrate_workload("cpu", get_size("tiny"), 128, "fp32", 2, concurrent=1, cache=tmp_path / "cal.json")
    assert m.calls == 2 and e["unsteady"] is False and e["attempts"] == 2
    assert "measuring again" in capsys.readouterr().err
    stored = workload.lookup_workload("cpu", "tiny", 128, "fp32", 2, 1, tmp_path / "cal.json")
    assert stored["repeats"][workload.pass_probe(1)] == _repeats()[workload.pass_probe(1)]
    assert stored["measured_at"] and stored["spread"]["n"] == workload.REPS


def test_a_models_first_probe_is_warmed_twice(monkeypatch):
    """Its first timed repeat ran 1.3-1.7x slow on a quiet machine after one warmup: the model's
    first probe gets ``FIRST_PROBE_WARMUP`` untimed passes, every copy the same (lockstep)."""
    events = []

    class Barrier:
        def wait(self, timeout):
            events.append("meet")

    monkeypatch.setattr(workload, "_lockstep", Barrier())
    assert len(workload._timed_repeats(lambda: events.append("pass"), 3, workload.FIRST_PROBE_WARMUP)) == 3
    assert workload.FIRST_PROBE_WARMUP == 2 and events == ["meet", "pass", "pass"] + ["meet", "pass"] * 3


def test_slowest_copy_is_taken_repeat_by_repeat():
    runs = [{"repeats": {"p": [1.0, 5.0, 2.0]}}, {"repeats": {"p": [3.0, 1.0, 2.5]}}]
    assert workload.slowest_copy(runs) == {"p": [3.0, 5.0, 2.5]}


# ---------------------------------------------------------------- a poisoned entry, end to end


def _spec() -> SweepSpec:
    return SweepSpec(sizes=("tiny",), strategies=("single",), precisions=("fp32",), gpus=(1,), device_kind="cpu",
                     batch=8, steps=3, warmup=1, reference=False)


def _poison(monkeypatch, tmp_path, **marks) -> tuple[dict, list]:
    """A workload entry 30x too slow (the issue's first bench) in a temp store, measured 3 h ago,
    with a steady matmul entry beside it; returns its fingerprint and the valid cells."""
    monkeypatch.setenv(store.ENV, str(tmp_path / "cal.json"))
    spec = _spec()
    cells = [c for c in expand(spec) if c.valid]
    ((dt, th),), ((size, seq, _, _, k, compiled),), _ = auto.needs(spec, cells)
    store.put("matmul", matmul.fingerprint("cpu", dt, th), {"tflops": 0.1, "shapes": [], "spread": {"ratio": 1.1},
                                                             "unsteady": False, "measured_at": "2026-01-01T00:00:00+0000"})
    fp = workload.workload_fingerprint("cpu", size.key, seq, dt, th, k, compiled)
    three_h_ago = time.strftime(provenance.TIME_FORMAT, time.localtime(time.time() - 3 * 3600))
    reps = _repeats(scale=30.0, outlier=(workload.pass_probe(1), 3.0))
    entry = {"measured_at": three_h_ago, **_entry(reps), "spread": steadiness.summary(reps), **marks}
    store.put("workload", fp, entry)
    return fp, cells


def _record(cells, speedup: float) -> dict:
    c = expand(_spec())[0]
    assert c.cell_id == cells[0].cell_id
    return {"cell_id": c.cell_id, "status": "ok", "predicted": c.predicted,
            "metrics": {"step_time_s": {"median": c.predicted["step_time_s"] / speedup}}}


def test_bench_measures_an_unsteady_entry_again_and_says_so(tmp_path, monkeypatch, capsys):
    fp, cells = _poison(monkeypatch, tmp_path, unsteady=True, unsteady_reason="pass 1 row repeats spread 3x")
    asked = []
    monkeypatch.setattr(auto, "calibrate_in_child", lambda args: (asked.append(args), (1, "boom"))[1])
    auto.ensure_calibrated(_spec(), cells)
    assert len(asked) == 1 and asked[0][-2:] == ["--force", "workload"], "the matmul entry is steady: reused"
    err = capsys.readouterr().err
    assert f"calibration: {provenance.label_of('workload', fp)}: stored entry is marked unsteady " \
           f"(pass 1 row repeats spread 3x); measuring again" in err


def test_bench_measures_an_entry_without_its_spread_again(tmp_path, monkeypatch, capsys):
    _, cells = _poison(monkeypatch, tmp_path, spread=None)
    asked = []
    monkeypatch.setattr(auto, "calibrate_in_child", lambda args: (asked.append(args), (1, "boom"))[1])
    auto.ensure_calibrated(_spec(), cells)
    assert len(asked) == 1 and "no record of its repeats' spread" in capsys.readouterr().err


def test_bench_reuses_a_steady_entry_unless_forced(tmp_path, monkeypatch):
    _, cells = _poison(monkeypatch, tmp_path, unsteady=False)
    asked = []
    monkeypatch.setattr(auto, "calibrate_in_child", lambda args: (asked.append(args), (0, "ok"))[1])
    auto.ensure_calibrated(_spec(), cells)
    assert asked == []
    auto._workloads(_spec(), auto.needs(_spec(), cells)[1], force=True)
    assert len(asked) == 1 and asked[0][-2:] == ["--force", "workload"]


def test_a_20x_misprediction_names_the_poisoned_entry_and_its_age(tmp_path, monkeypatch):
    fp, cells = _poison(monkeypatch, tmp_path, unsteady=True, unsteady_reason="pass 1 row repeats spread 3x")
    record = _record(cells, speedup=20.0)
    sources = record["predicted"]["calibration"]
    assert [s["kind"] for s in sources] == ["workload"] and sources[0]["key"] == store.key("workload", fp)
    assert any("is unsteady" in n for n in record["predicted"]["notes"]), "a prediction from it is flagged"
    note = provenance.misprediction_note(record, store_path=tmp_path / "cal.json")
    assert note is not None and "\n" not in note
    assert note.startswith(f"{record['cell_id']}: measured step ") and "is 20x faster than predicted" in note
    assert f"predicted from {provenance.label_of('workload', fp)} (measured 3 h ago, repeats spread 3.06x (pass 1 row), " \
           f"stored unsteady)" in note
    assert note.endswith(provenance.fix_command("workload", fp))
    assert "--force workload" in note and "--workloads tiny" in note
    assert provenance.misprediction_note(_record(cells, speedup=2.0)) is None  # within 3x: the model's own error


def test_misprediction_note_edges():
    rec = {"cell_id": "c", "predicted": {"step_time_s": 1.0}, "metrics": {"step_time_s": {"median": 4.0}}}
    note = provenance.misprediction_note(rec)
    assert note.startswith("c: measured step 4000 ms is 4x slower than predicted (1000 ms; the limit is 3x)")
    assert "names no calibration entry" in note
    assert provenance.misprediction_note(rec, factor=5.0) is None
    assert provenance.misprediction_note({"predicted": {"step_time_s": None}, "metrics": {}}) is None
    assert provenance.misprediction_note({"status": "oom", "predicted": None}) is None
    with pytest.raises(ValueError, match=r"factor \(1\.0\) must be > 1"):
        provenance.misprediction_note(rec, factor=1.0)


def test_age_and_labels():
    now = time.time()
    stamp = time.strftime(provenance.TIME_FORMAT, time.localtime(now - 3 * 3600 - 100))
    assert provenance.age_text(stamp, now) == "3 h ago"
    assert provenance.age_text(time.strftime(provenance.TIME_FORMAT, time.localtime(now - 90000)), now) == "1 day ago"
    assert provenance.age_text(None) == "at an unknown time" and provenance.age_text("now") == "at now"
    fp = workload.workload_fingerprint("cpu", "tiny", 128, "fp32", 2, 2)
    assert provenance.label_of("workload", fp) == "workload tiny seq 128 fp32 cpu threads=2 x2"
    assert provenance.fix_command("workload", fp) == ("harness calibrate --force workload --device cpu --no-comm "
                                                      "--workloads tiny --seq-len 128 --dtype fp32 --threads 2 "
                                                      "--concurrent 2")


# ---------------------------------------------------------------- harness calibrate --force


def test_calibrate_force_names_what_it_measured_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(store.ENV, str(tmp_path / "cal.json"))
    fake = {"tflops": 0.25, "median_tflops": 0.2, "best_shape": [8, 8, 8], "shapes": [{"tflops": 0.25}],
            "repeats": {"best shape 8x8x8": [1e-3, 1.1e-3]}}
    monkeypatch.setattr(matmul, "measure", lambda device_kind, dtype: fake)
    args = ["calibrate", "--device", "cpu", "--dtype", "fp32", "--threads", "1", "--no-comm"]
    assert main(args) == 0
    assert "(measured now, repeats spread 1.1x)" in capsys.readouterr().out
    assert main([*args, "--force"]) == 0
    out = capsys.readouterr().out
    assert "re-measured (--force): matmul cpu fp32 threads=1 (the stored entry was measured 20" in out
    assert main([*args, "--force", "workload"]) == 0  # matmul not listed: served from the store
    assert "(cached, measured" in capsys.readouterr().out


def test_calibrate_force_rejects_an_unknown_kind(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(store.ENV, str(tmp_path / "cal.json"))
    monkeypatch.setattr(matmul, "calibrate", lambda *a, **k: pytest.fail("measured before the flags were checked"))
    assert main(["calibrate", "--device", "cpu", "--no-comm", "--force", "gemm"]) == 2
    assert "--force 'gemm': choose from matmul, comm, workload" in capsys.readouterr().err

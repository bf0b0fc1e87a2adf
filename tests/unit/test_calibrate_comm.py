"""Bus bandwidth arithmetic (nccl-tests PERFORMANCE.md), the comm-time model, size parsing, the shared cache."""

from __future__ import annotations

import json
import statistics

import pytest

from harness.calibration import collectives as cc
from harness.calibration import matmul as calibrate
from harness.calibration import store, workload
from harness.cli import main
from harness.model import comm_fit


def test_busbw_factors_match_nccl_tests():
    # all_reduce at n=4: S=1e9 B in 1 s -> algbw 1 GB/s, busbw x 2(n-1)/n = 1.5 GB/s
    assert cc.bandwidths("all_reduce", 4, 10**9, 1.0) == pytest.approx((1.0, 1.5))
    assert cc.bandwidths("all_gather", 4, 10**9, 2.0) == pytest.approx((0.5, 0.375))
    assert cc.bandwidths("reduce_scatter", 8, 8 * 10**9, 1.0) == pytest.approx((8.0, 7.0))
    assert cc.bandwidths("all_to_all", 2, 10**9, 1.0) == pytest.approx((1.0, 0.5))
    assert cc.bandwidths("broadcast", 4, 10**9, 1.0) == pytest.approx((1.0, 1.0))
    assert cc.bandwidths("send_recv", 4, 10**9, 0.5) == pytest.approx((2.0, 2.0))
    with pytest.raises(ValueError, match="unknown collective 'allreduce'; choose from all_reduce"):
        cc.bus_factor("allreduce", 2)


def test_sizes_double_and_split_exactly():
    assert cc.sizes(4096, 65536, 2) == [4096, 8192, 16384, 32768, 65536]
    assert cc.sizes(4096, 16384, 3) == [4104, 8196, 16392]  # multiples of 4 * 3: every rank's share is whole fp32
    assert cc.sizes(1, 1, 4) == [16]


ENTRY = {
    "kind": "comm",
    "fingerprint": {"world_size": 4},
    "collectives": {"all_reduce": [
        {"bytes": 1000, "time_s": 1e-4},
        {"bytes": 2000, "time_s": 2e-4},
        {"bytes": 4000, "time_s": 6e-4},
    ]},
}


def test_fitted_time_rejects_unknown_collectives_and_negative_sizes():
    assert comm_fit.fitted_time_s(ENTRY, "all_reduce", 0) == 0.0
    with pytest.raises(ValueError, match="no measurement of 'broadcast'"):
        comm_fit.fitted_time_s(ENTRY, "broadcast", 100)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        comm_fit.fitted_time_s(ENTRY, "all_reduce", -1)


@pytest.mark.parametrize("text,expected", [("4MiB", 4 << 20), ("1KiB", 1024), ("1048576", 1 << 20), ("64 kib", 65536),
                                           ("2GiB", 2 << 30), ("512B", 512)])
def test_parse_size(text, expected):
    assert cc.parse_size(text) == expected


@pytest.mark.parametrize("text", ["12XB", "4MB", "", "0", "-4KiB", "1.5MiB", "KiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="is not a size; give a positive integer of bytes or a KiB/MiB/GiB suffix"):
        cc.parse_size(text)


def test_human_bytes():
    assert [cc.human_bytes(n) for n in (512, 4096, 65536, 4104, 4 << 20, 1 << 30)] == \
        ["512B", "4KiB", "64KiB", "4.0KiB", "4MiB", "1GiB"]


def _comm_result(world_size: int) -> dict:
    rows = [{"bytes": 4096, "time_s": 1e-3, "algbw_gbps": 0.004096, "busbw_gbps": 0.004096}]
    return {"fingerprint": cc.fingerprint("cpu", world_size), "measured_at": "now",
            "collectives": {c: rows for c in cc.COLLECTIVES},
            "summary": {c: {"peak_busbw_gbps": 0.004096, "latency_s": 1e-3} for c in cc.COLLECTIVES}, "sync_s": 2e-3}


def test_cache_merge_keeps_matmul_entries(tmp_path, monkeypatch):
    cache = tmp_path / "cal.json"
    fp = calibrate.fingerprint("cpu", "fp32", 2)
    matmul = {"fingerprint": fp, "tflops": 0.1, "shapes": []}
    cache.write_text(json.dumps({store.key("matmul", fp): matmul}))
    cc.store_comm(_comm_result(2), cache)
    cc.store_comm(_comm_result(4), cache)

    entries = json.loads(cache.read_text())
    assert len(entries) == 3
    assert calibrate.lookup("cpu", "fp32", 2, cache) == matmul
    hit = cc.lookup_comm("cpu", 2, cache=cache)
    assert hit is not None and hit["kind"] == "comm" and hit["fingerprint"]["world_size"] == 2
    assert cc.lookup_comm("cpu", 4, cache=cache)["fingerprint"]["world_size"] == 4
    assert cc.lookup_comm("cpu", 3, cache=cache) is None
    assert cc.lookup_comm("cpu", 2, nnodes=2, cache=cache) is None
    monkeypatch.setenv("HARNESS_CALIBRATION", str(cache))  # the default cache is the same file
    assert cc.lookup_comm("cpu", 2) == hit
    # a cached entry is reused only when it covers the sizes asked for
    assert cc.calibrate_comm("cpu", 2, 4096, 4096, cache=cache) == hit
    assert not cc._covers(hit, 4096, 8192)


def test_matmul_lookup_ignores_entries_with_a_kind(tmp_path):
    cache = tmp_path / "cal.json"
    fp = calibrate.fingerprint("cpu", "fp32", 2)
    cache.write_text(json.dumps({store.key("matmul", fp): {"kind": "comm", "fingerprint": fp}}))
    assert calibrate.lookup("cpu", "fp32", 2, cache) is None


def _landscape(peak: tuple[int, int, int], top: float = 800.0):
    """A synthetic TFLOP/s surface, single-peaked at ``peak`` (falls 1% per 256 off it on each axis)."""
    def rate(shape):
        return top * 0.99 ** (sum(abs(a - b) for a, b in zip(shape, peak)) / 256)
    return rate


def test_search_covers_the_grid_up_to_16384_then_climbs_to_an_off_grid_peak():
    timed = []
    rate = _landscape((4352, 8192, 3840))
    out = calibrate.search(lambda s: timed.append(s) or rate(s), calibrate.GPU_PLAN, max_rep_s=1e9)
    grid = {(m, n, k) for m in calibrate.GPU_PLAN.dims for n in calibrate.GPU_PLAN.dims for k in calibrate.GPU_PLAN.dims}
    assert max(calibrate.GPU_PLAN.dims) >= 16384 and grid <= set(timed)
    assert len(timed) == len(set(timed)), "a shape was timed twice"
    # from the grid's best (4096, 8192, 4096): one 256 step up on m, one down on k
    assert out["best_shape"] == [4352, 8192, 3840] and out["tflops"] == pytest.approx(800.0)
    assert out["median_tflops"] == pytest.approx(statistics.median(rate(s) for s in timed))
    assert len(out["shapes"]) == len(timed)


def test_search_stops_climbing_after_its_budget():
    plan = calibrate.SearchPlan(dims=(256, 8192), step=256, climbs=2, reference=(256, 256, 256), warm_s=0, repeats=1)
    out = calibrate.search(_landscape((4096, 256, 256)), plan, max_rep_s=1e9)
    assert out["best_shape"] == [768, 256, 256]  # two climbs from 256 along m, not the far peak


def test_search_skips_shapes_too_slow_at_the_best_rate_so_far():
    plan = calibrate.SearchPlan(dims=(8, 16, 32), step=8, climbs=0, reference=(8, 8, 8), warm_s=0, repeats=1)
    timed = []
    # 1 GFLOP/s: a 32x32x32 product (65536 flop) takes 65.5 us; allow 40 us.
    calibrate.search(lambda s: timed.append(s) or 1e-3, plan, max_rep_s=40e-6)
    assert all(calibrate.flops(s) <= 40e-6 * 1e9 for s in timed[1:]) and (32, 32, 32) not in timed
    assert (16, 16, 16) in timed


def test_measure_reports_max_median_best_shape_and_the_reference_square(monkeypatch):
    # Seconds per product by m: TFLOP/s of the (m, m, m) squares are 1.024e-3, 2.048e-3 and 6.5536e-4.
    times = {8: 1e-6, 16: 4e-6, 32: 1e-4}
    monkeypatch.setattr(calibrate, "_time_matmul", lambda a, b, cuda, min_time_s, repeats: [times[a.shape[0]] *
                        (a.shape[1] * b.shape[1]) / a.shape[0] ** 2])
    plan = calibrate.SearchPlan(dims=(8, 16, 32), step=8, climbs=0, reference=(16, 16, 16), warm_s=0, repeats=1)
    out = calibrate.measure("cpu", "fp32", plan=plan)
    assert out["tflops"] == pytest.approx(2.048e-3, rel=1e-9, abs=0) and out["best_shape"][0] == 16
    assert out["reference_shape"] == [16, 16, 16] and out["reference_tflops"] == pytest.approx(2.048e-3, rel=1e-9)
    assert out["median_tflops"] == pytest.approx(statistics.median(s["tflops"] for s in out["shapes"]))
    assert len(out["shapes"]) == 27 and out["search"]["dims"] == [8, 16, 32]


def test_a_timing_window_is_seconds_per_call_on_a_clock_only_the_calls_move(monkeypatch):
    """``time_windows`` on a stubbed clock (issue 61: a calibration's unit checked by value, not as "positive"): each
    call lasts 3 ms; a window of at least 10 ms needs 4 calls (1, 2, then 4: 3, 6, 12 ms), so each of the 3 windows is
    12 ms / 4 = 3 ms a call exactly; 1 warmup call + 1 + 2 + 4 + 2 more windows of 4 = 16 calls."""
    now, calls = [0.0], []

    def call() -> None:
        calls.append(now[0])
        now[0] += 0.003

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: now[0])
    windows = calibrate.time_windows(call, cuda=False, min_time_s=0.010, repeats=3)
    assert windows == pytest.approx([0.003] * 3, rel=1e-12) and len(calls) == 16
    # a cap on the calls ends the growth: 2 calls a window (6 ms, short of 10 ms), still 3 ms a call
    calls.clear()
    assert calibrate.time_windows(call, cuda=False, min_time_s=0.010, repeats=2, max_reps=2) == pytest.approx(
        [0.003, 0.003], rel=1e-12)
    assert len(calls) == 1 + 1 + 2 + 2


@pytest.mark.parametrize("args,message", [
    (["--comm-max-bytes", "12XB"], "--comm-max-bytes '12XB' is not a size; give a positive integer of bytes"),
    (["--comm-min-bytes", "0"], "--comm-min-bytes '0' is not a size"),
    (["--comm-min-bytes", "1MiB", "--comm-max-bytes", "4KiB"],
     "--comm-min-bytes (1048576) must be <= --comm-max-bytes (4096)"),
    (["--gpus", "0"], "--gpus '0': must be an integer >= 1"),
    (["--gpus", "two"], "--gpus 'two': must be an integer >= 1"),
])
def test_calibrate_bad_input_exits_2_before_anything_runs(args, message, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cal.json"
    monkeypatch.setenv("HARNESS_CALIBRATION", str(cache))
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("matmul ran before validation"))
    rc = main(["calibrate", "--device", "cpu", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not cache.exists()


def test_one_rank_skips_comm(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: {"tflops": 1.0, "median_tflops": 0.5,
                                                                  "best_shape": [1, 1, 1], "shapes": [{}]})
    monkeypatch.setattr(cc, "calibrate_comm", lambda *a, **k: pytest.fail("comm ran with one rank"))
    assert main(["calibrate", "--device", "cpu", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 TFLOP/s max, 0.5 median over 1 shapes" in out
    assert "comm: n/a: bus bandwidth needs >= 2 ranks" in out


def test_alpha_beta_fit_recovers_latency_and_bandwidth_through_noise():
    # t = 2 ms + S / 0.5 GB/s, with +-0.5 ms scheduling noise at the small sizes
    noise = [5e-4, -5e-4, 4e-4, -4e-4, 0, 0, 0]
    sizes_ = [4096 * 4**i for i in range(7)]
    rows = [{"bytes": b, "time_s": 2e-3 + b / 0.5e9 + e} for b, e in zip(sizes_, noise)]
    entry = {"collectives": {"all_reduce": rows}, "sync_s": 1e-3}
    alpha, beta = comm_fit.alpha_beta(entry, "all_reduce")
    assert alpha == pytest.approx(2e-3, abs=2e-4) and beta == pytest.approx(0.5e9, rel=0.02)
    t = comm_fit.fitted_time_s(entry, "all_reduce", 1 << 20)
    assert t == pytest.approx(alpha + (1 << 20) / beta)
    assert comm_fit.fitted_time_s(entry, "all_reduce", 1 << 20, after_compute=True) == pytest.approx(t + 1e-3)
    assert comm_fit.fitted_time_s(entry, "all_reduce", 0, after_compute=True) == 0.0


def test_entries_without_a_sync_cost_are_not_reused(tmp_path):
    cache = tmp_path / "cal.json"
    old = _comm_result(2)
    del old["sync_s"]
    cc.store_comm(old, cache)
    assert cc.lookup_comm("cpu", 2, cache=cache) is None


def test_calibrate_says_whether_it_measured_or_served_the_store(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_CALIBRATION", str(tmp_path / "cal.json"))
    fake = {"tflops": 0.25, "median_tflops": 0.2, "best_shape": [8, 8, 8], "shapes": [{"tflops": 0.25}]}
    monkeypatch.setattr(calibrate, "measure", lambda device_kind, dtype: fake)
    args = ["calibrate", "--device", "cpu", "--dtype", "fp32", "--threads", "1", "--no-comm"]
    assert main(args) == 0
    assert "0.25 TFLOP/s max" in (first := capsys.readouterr().out) and "(measured now)" in first
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("a stored entry was measured again"))
    assert main(args) == 0
    assert "(cached, measured 20" in capsys.readouterr().out


def test_unwritable_store_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HARNESS_CALIBRATION", str(blocker / "cal.json"))  # its folder is a file
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("measured with nowhere to keep it"))
    rc = main(["calibrate", "--device", "cpu", "--no-comm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"calibration store {blocker / 'cal.json'} is not writable" in err[0]
    assert "HARNESS_CALIBRATION=" in err[0]


def test_bench_falls_back_to_the_run_directory_when_the_store_is_unwritable(tmp_path, capsys, monkeypatch):
    from harness.cli.bench import _calibration_store

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HARNESS_CALIBRATION", str(blocker / "cal.json"))
    _calibration_store(tmp_path / "run")
    assert store.default_path() == tmp_path / "run" / "calibration.json"
    assert "is not writable" in capsys.readouterr().out


def test_only_valid_cells_are_calibrated_for():
    from harness.calibration.auto import needs
    from harness.planner import expand
    from harness.spec import SweepSpec

    spec = SweepSpec(sizes=("tiny",), strategies=("tp",), precisions=("fp32",), gpus=(3,), device_kind="cpu",
                     batch=6, steps=3, warmup=1, reference=False)
    cells = expand(spec)
    assert not any(c.valid for c in cells)  # tp 3 does not divide 4 heads
    assert needs(spec, [c for c in cells if c.valid]) == (set(), set(), set()), "no 3-rank collectives to measure"
    spec4 = SweepSpec(**{**spec.__dict__, "gpus": (4,), "batch": 8, "reference": True})
    matmuls, workloads, comms = needs(spec4, [c for c in expand(spec4) if c.valid])
    assert comms == {4, 2} and {w[4] for w in workloads} == {1, 4} and not any(w[5] for w in workloads)


def test_workload_copies_meet_before_every_timed_pass(monkeypatch):
    """The K copies of a workload calibration time each pass in lockstep, as ranks meet at every
    step's collectives: a barrier before the warmup and before each timed repeat, the same count
    in every copy (a copy that met fewer times would leave the others waiting)."""
    events = []

    class Barrier:
        def wait(self, timeout):
            assert timeout == workload.BARRIER_TIMEOUT_S
            events.append("meet")

    monkeypatch.setattr(workload, "_lockstep", Barrier())
    assert len(workload._timed_repeats(lambda: events.append("pass"), 3)) == 3
    assert events == ["meet", "pass"] * 4

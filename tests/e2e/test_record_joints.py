"""The joints between the worker, the record builder and the formulas, on real 4-rank records.

The formulas have exact unit tests; these hold what the worker and the sweep fed them: which world
size, which degree, which steps lie inside the measured window. Every number is recomputed from the
record's own samples and configuration (never from the metric it checks), for a tensor-parallel, a
pipeline and a hybrid (fsdp+tp) cell at 4 CPU ranks and the single-device reference (``bench_run``,
one ``harness bench`` per test session, tests/e2e/conftest.py).
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import replace

import pytest

from harness.run.formulas import OVERHEAD_PARTS
from workloads.sizes import get_size

pytestmark = pytest.mark.e2e
STRATEGIES = ("single", "tp", "pp", "fsdp+tp")
EXPECTED_DEGREES = {
    "single": {"dp_replicate": 1, "dp_shard": 1, "pp": 1, "tp": 1},
    "tp": {"dp_replicate": 1, "dp_shard": 1, "pp": 1, "tp": 4},
    "pp": {"dp_replicate": 1, "dp_shard": 1, "pp": 4, "tp": 1},
    "fsdp+tp": {"dp_replicate": 1, "dp_shard": 2, "pp": 1, "tp": 2, "sp": 1},  # sequence parallel: the hybrid's default
}
ADAM_BYTES_PER_PARAM = 4 + 4 + 8
"""fp32 parameter, gradient, and AdamW's two moments; plus one 4-byte ``step`` per tensor."""


@pytest.fixture(scope="module")
def cells(bench_run) -> dict[str, dict]:
    out = {s: bench_run.cell(s) for s in STRATEGIES}
    for s, rec in out.items():
        assert rec["status"] == "ok", f"{s}: {rec['status']}: {rec['error']}"
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_cell_ran_at_its_world_size_and_degrees(cells, strategy):
    rec = cells[strategy]
    cfg = rec["config"]
    assert cfg["world_size"] == (1 if strategy == "single" else 4)
    assert cfg["degrees"] == EXPECTED_DEGREES[strategy]
    assert math.prod(v for k, v in cfg["degrees"].items() if k != "sp") == cfg["world_size"]
    m = rec["metrics"]
    for per_rank in (m["peak_mem_gib_per_rank"], m["model_state_bytes_by_rank"], m["comm_by_rank"],
                     rec["samples"]["step_time_s_per_rank"]):
        assert len(per_rank) == cfg["world_size"], "one entry per rank"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_measured_window_is_exactly_the_measured_steps(cells, strategy):
    """Warmup outside, every measured step inside, nothing after (comm count, tensor bytes, probe)."""
    rec = cells[strategy]
    cfg, m, s = rec["config"], rec["metrics"], rec["samples"]
    per_rank = s["step_time_s_per_rank"]
    assert all(len(r) == cfg["steps"] for r in per_rank)
    assert len(s["warmup_step_time_s"]) == cfg["warmup"]
    assert s["step_time_s"] == [max(col) for col in zip(*per_rank)], "a step's time is the slowest rank's"
    assert m["step_time_s"]["n"] == cfg["steps"]
    assert m["step_time_s"]["median"] == pytest.approx(statistics.median(s["step_time_s"]), rel=1e-12)
    assert m["step_time_s"]["mean"] == pytest.approx(statistics.fmean(s["step_time_s"]), rel=1e-12)
    assert len(m["loss"]) == cfg["warmup"] + cfg["steps"] and m["final_loss"] == m["loss"][-1]
    # Rank 0 timed its steps inside the worker, and the worker ran inside the launcher's job.
    assert sum(per_rank[0]) < m["worker_wall_s"] < m["wall_s"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_device_throughput_is_the_formula_of_the_cells_own_numbers(cells, strategy):
    rec = cells[strategy]
    cfg, m = rec["config"], rec["metrics"]
    tokens = cfg["global_batch"] * cfg["seq_len"]
    median = statistics.median(rec["samples"]["step_time_s"])
    flops_per_token = get_size(cfg["size"]).flops_per_token(cfg["seq_len"])
    assert m["tokens_per_step"] == tokens
    assert m["tokens_per_s"] == pytest.approx(tokens / median, rel=1e-9)
    # per device: over every device the cell holds (tp and pp ranks count, not just data-parallel ones)
    assert m["tokens_per_s_per_device"] == pytest.approx(tokens / median / cfg["world_size"], rel=1e-9)
    assert m["tflops_per_device"] == pytest.approx(flops_per_token * tokens / median / cfg["world_size"] / 1e12,
                                                   rel=1e-9)
    assert rec["workload"]["seq_len"] == cfg["seq_len"]
    assert m["mfu_pct"] is None and m["mfu_reason"].startswith("n/a: no datasheet peak for CPU")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_rank_maxima_and_sums(cells, strategy):
    m = cells[strategy]["metrics"]
    assert m["peak_mem_gib"] == max(m["peak_mem_gib_per_rank"])
    assert m["peak_tensor_gib"] == pytest.approx(max(m["peak_tensor_gib_per_rank"]))
    assert m["model_state_bytes_per_rank"] == max(m["model_state_bytes_by_rank"])
    assert m["model_state_bytes_by_rank"][0] == m["model_state_breakdown_rank0"]["total"]
    assert m["comm"] == m["comm_by_rank"][0], "the table's comm is rank 0's"
    assert m["comm_bytes_per_step"] == sum(c["bytes_per_step"] for c in m["comm"].values())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_model_predicts_every_ranks_states_and_comm_of_the_record(cells, strategy):
    """The model's per-rank formulas (harness/model) against what the 4-rank cell counted, rank by rank."""
    rec = cells[strategy]
    p, m = rec["predicted"], rec["metrics"]
    assert p["model_state_bytes_by_rank"] == m["model_state_bytes_by_rank"]
    assert p["comm_by_rank"] == m["comm_by_rank"]
    assert p["step_time_s"] is None and any("harness calibrate" in n for n in p["notes"]), "--no-calibrate: n/a"


def test_pipeline_stages_hold_every_parameter_once(cells):
    """Each of the 4 stages holds its own layers: the states of all ranks sum to the whole model's, once."""
    rec = cells["pp"]
    m, n_tensors = rec["metrics"], len(rec["samples"]["param_norms_step1"])
    params = replace(get_size(rec["config"]["size"]), seq_len=rec["config"]["seq_len"]).params
    assert rec["workload"]["params"] == params
    assert sum(m["model_state_bytes_by_rank"]) == ADAM_BYTES_PER_PARAM * params + 4 * n_tensors
    assert len(set(m["model_state_bytes_by_rank"])) > 1, "the first and last stages hold embeddings and head"


def test_pipeline_schedule_and_its_sends_are_the_cells(cells):
    rec = cells["pp"]
    cfg, pipe, comm = rec["config"], rec["metrics"]["pipeline"], rec["metrics"]["comm"]
    p, m = cfg["degrees"]["pp"], cfg["microbatches"]
    idle = pipe["idle_over_busy_by_rank"]  # the measured parts (actions_ms_by_rank: the test below)
    assert {k: v for k, v in pipe.items() if k not in ("idle_over_busy_by_rank", "actions_ms_by_rank")} == {
        "stages": p, "virtual_per_rank": 1, "microbatches": m, "expected_bubble": (p - 1) / m}
    # each rank's wait over its compute: one per rank, and a pipeline rank does wait ((step - CPU) / CPU > 0)
    assert len(idle) == cfg["world_size"] and all(x is not None and x > 0 for x in idle), idle
    assert rec["predicted"]["pipeline_bubble_by_rank"] == pytest.approx([(p - 1) / m] * p)
    activation = cfg["global_batch"] // m * cfg["seq_len"] * get_size(cfg["size"]).d_model * 4  # fp32 (b, S, d)
    assert comm["send"] == {"calls_per_step": m, "bytes_per_step": m * activation}, "one send per microbatch"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_cells_time_adds_up_and_holds_its_measured_steps(cells, strategy):
    """metrics.overhead: the job's parts sum to its wall, the probes are the sweep's, and the measured
    part holds rank 0's measured steps (it adds only what lies between them: data, heartbeats)."""
    rec = cells[strategy]
    m, parts = rec["metrics"], rec["metrics"]["overhead"]["parts_s"]
    assert list(parts) == [*OVERHEAD_PARTS, "machine_probe"] and min(parts.values()) >= 0
    assert sum(parts[p] for p in OVERHEAD_PARTS) == pytest.approx(m["wall_s"], abs=1e-6)  # epoch floats: ~1e-7 s
    assert parts["machine_probe"] == pytest.approx(sum(m["machine_probe_s"].values()))
    assert m["overhead"]["total_s"] == pytest.approx(sum(parts.values()))
    assert parts["measured"] >= sum(rec["samples"]["step_time_s_per_rank"][0])
    assert m["overhead"]["measured_share"] == pytest.approx(parts["measured"] / m["overhead"]["total_s"])
    assert parts["profile"] == 0.0, "no --profile: no profiled steps"


@pytest.mark.parametrize("strategy", ("tp", "pp", "fsdp+tp"))
def test_parity_is_against_the_runs_single_device_cell(cells, strategy):
    parity = cells[strategy]["metrics"]["parity"]
    assert parity["reference"] == cells["single"]["cell_id"]
    assert parity["ok"] is True, parity


def test_bench_writes_records_summary_and_report(bench_run, cells):
    """bench -> records -> report: one record per planned cell, tables and the report built from them."""
    kinds = [r["kind"] for r in bench_run.records]
    assert kinds[0] == "calibration" and kinds.count("cell") == len(STRATEGIES)
    for rec in cells.values():
        assert rec["schema_version"] == 1 and rec["error"] is None
        for key in ("git_sha", "git_dirty", "python", "torch", "device_name", "cpu_model", "hostname"):
            assert key in rec["env"], key
    summary = (bench_run.out / "summary.md").read_text()
    assert summary.startswith("# Benchmark summary, produced on cpu")
    assert f"Time: {len(STRATEGIES)} cells took " in summary and "were measured steps" in summary
    for rec in cells.values():
        assert rec["cell_id"] in summary, rec["cell_id"]
    with open(bench_run.out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["cell_id"] for r in rows) == sorted(r["cell_id"] for r in cells.values())
    assert (bench_run.out / "report.html").stat().st_size > 0
    empty = [str(p.relative_to(bench_run.out)) for p in bench_run.out.rglob("*")
             if p.is_file() and not p.stat().st_size and not p.name.startswith(".harness.lock")]  # the run's flock
    assert empty == [], f"a run directory keeps no empty file (torchrun's silent rank logs): {empty}"
    assert "summary: " in bench_run.stdout


def test_each_pipeline_rank_splits_its_measured_steps_into_its_stage_actions(cells, bench_run):
    """The pp cell (1F1B, 4 stages): every rank ran forwards and whole backwards (no I or W: not a zero-bubble
    schedule); the first rank receives nothing before its forwards, yet waits on its gradients; the parts and
    ``other`` add up to the rank's mean measured step, recomputed from the record's samples."""
    rec = cells["pp"]
    split = rec["metrics"]["pipeline"]["actions_ms_by_rank"]
    per_rank = rec["samples"]["step_time_s_per_rank"]
    assert len(split) == rec["config"]["world_size"] == 4
    for parts, steps in zip(split, per_rank):
        assert parts["forward"] > 0 and parts["backward"] > 0 and parts["p2p_wait"] > 0
        assert parts["backward_input"] == parts["backward_weight"] == 0.0
        assert sum(parts.values()) == pytest.approx(1e3 * statistics.fmean(steps), rel=1e-9)
        assert parts["other"] > 0  # the schedule's own bookkeeping is not one of the timed calls
    summary = (bench_run.out / "summary.md").read_text()
    assert "## Pipeline stage actions" in summary and rec["cell_id"] in summary.split("## Pipeline stage actions")[1]

"""``--batch auto``: the search's trials, what ends it, and what the CLI refuses before anything runs.

The trials here are fakes that fit up to a known batch (a real trial is a whole launched cell;
``results/reference/batch-auto-cpu-tiny-w2`` is a search through the real launcher, command beside it).
"""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.run import batch_search
from harness.run.launch import Outcome
from harness.spec import CellConfig


def _cfg(**kw) -> CellConfig:
    base = dict(size="tiny", strategy="ddp", precision="fp32", world_size=2, global_batch=2, seq_len=64, steps=5,
                warmup=1, device_kind="cpu", scaling="weak", batch_auto=True)
    return CellConfig(**{**base, **kw})


def _trials(fit_rows: int, status_over: str = "oom"):
    seen: list[tuple[int, str]] = []

    def run(cfg: CellConfig, name: str) -> Outcome:
        rows = cfg.global_batch // cfg.layout.dims.dp
        seen.append((rows, name))
        assert cfg.steps == 5 and cfg.warmup == 1  # the whole cell, not a shortened run
        ok = rows <= fit_rows
        return Outcome(status="ok" if ok else status_over, error=None if ok else "boom", returncode=0 if ok else 3,
                       result={"metrics": {"peak_mem_gib": 0.01 * rows}} if ok else None, wall_s=1.0)

    return run, seen


def test_doubles_then_bisects_to_the_largest_batch_that_fits():
    run, seen = _trials(fit_rows=11)
    found = batch_search.search(_cfg(), run)
    assert found.rows_per_rank == 11
    assert [r for r, _ in seen] == [1, 2, 4, 8, 16, 12, 10, 11]
    assert [t["status"] for t in found.trials] == ["ok", "ok", "ok", "ok", "oom", "oom", "ok", "ok"]
    assert [name for _, name in seen] == [f"b{r}" for r, _ in seen]
    assert found.trials[0]["global_batch"] == 2 and found.trials[0]["peak_mem_gib"] == pytest.approx(0.01)
    assert found.outcome.result["metrics"]["peak_mem_gib"] == pytest.approx(0.11), "the found trial is the measurement"


def test_pipeline_batches_stay_multiples_of_the_microbatches():
    run, seen = _trials(fit_rows=20)
    cfg = _cfg(strategy="pp", microbatches=4, global_batch=4)
    found = batch_search.search(cfg, run)
    assert all(r % 4 == 0 for r, _ in seen) and found.rows_per_rank == 20


def test_nothing_fits_and_a_crashed_trial_end_the_search():
    run, _ = _trials(fit_rows=0)
    assert batch_search.search(_cfg(), run).rows_per_rank is None
    run, seen = _trials(fit_rows=3, status_over="crashed")
    with pytest.raises(batch_search.TrialFailed, match="trial at 4 sequences per rank ended crashed") as e:
        batch_search.search(_cfg(), run)
    assert [t["status"] for t in e.value.trials] == ["ok", "ok", "crashed"]


def test_a_search_that_ends_without_a_batch_records_the_batch_it_ran():
    """The record of a crashed (or nothing-fit) search carries the trial that ended it, not the
    plan's placeholder batch: a reader sees which batch crashed."""
    from harness.planner import PlannedCell
    from harness.run.sweep import _search_batch

    cfg = _cfg()
    cell = PlannedCell(cell_id=cfg.cell_id, config=cfg, raw={}, valid=True, reason=None)
    run, _ = _trials(fit_rows=3, status_over="crashed")
    crashed, found, outcome = _search_batch(cell, run, None)
    assert outcome.status == "crashed" and found.rows_per_rank is None
    assert crashed.config.global_batch == 4 * 2 and crashed.cell_id == cell.cell_id  # 4 per rank x 2 ranks
    run, _ = _trials(fit_rows=0)
    none_fit, _, outcome = _search_batch(cell, run, None)
    assert outcome.status == "oom" and none_fit.config.global_batch == 1 * 2
    run, _ = _trials(fit_rows=11)
    fit, found, outcome = _search_batch(cell, run, None)
    assert outcome.status == "ok" and fit.config.global_batch == 11 * 2


@pytest.mark.parametrize("args,message", [
    (["--batch", "auto"], "--batch auto with --scaling strong: auto finds the batch per device"),
    (["--batch", "auto", "--scaling", "weak"], "--batch auto on CPU needs --mem-cap-gib"),
    (["--batch", "auto", "--scaling", "weak", "--mem-cap-gib", "1", "--lr-rule", "linear"],
     "--batch auto with an LR rule needs --base-batch"),
])
def test_bad_batch_auto_exits_2_with_one_line(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    out = tmp_path / "run"
    rc = main(["bench", "--device", "cpu", "--no-calibrate", "--out", str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()

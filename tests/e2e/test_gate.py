"""The regression gate end to end on CPU: real runs, a really slower candidate, real exit codes.

The slowdown is real extra work in every training step (a busy wait twice the step's own time, so
the candidate runs at about a third of the base's speed whatever the machine's load that hour),
injected by this test through ``tests/e2e/inject_gate/sitecustomize.py``, not by any flag of the
product. A fixed count of extra forward passes, used before, measured from 0.46 to 0.64 of the base
on this machine against the 0.60 bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timing]
REPO = Path(__file__).resolve().parents[2]
SLOW = Path(__file__).resolve().parent / "inject_gate"
CELL = ["--device", "cpu", "--gpus", "1", "--sizes", "tiny", "--strategies", "single", "--batch", "4",
        "--steps", "12", "--warmup", "2", "--no-calibrate"]
# Separate runs on a shared 2-core machine differ by up to ~35% as a whole (measured: an unchanged
# rerun at 0.66 normalised), so this end-to-end test of the committed-baseline mode uses a 40%
# threshold and a candidate that does ~3x the work. It does not normalise: the calibration
# workload, measured once per run, amplified noise (an unchanged rerun judged "slower by 54.8%"
# in a CI run of this suite); CI's own gate is the A/B mode (tests/e2e/test_gate_ab.py).
GATE = ["--threshold", "0.4"]


def _env(tmp: Path, slowdown: float = 0.0) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env.update(PYTHONPATH=os.pathsep.join([str(SLOW), str(REPO)]), HARNESS_FORCE_CPU="1",
               HARNESS_CALIBRATION=str(tmp / "cal.json"), HARNESS_TEST_SLOWDOWN=str(slowdown))
    return env


def _harness(tmp: Path, *args: str, slowdown: float = 0.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], env=_env(tmp, slowdown), cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gate")
    out = {}
    for name, args, slow in (("base", CELL, 0), ("same", CELL, 0), ("slow", CELL, 2.0)):
        r = _harness(tmp, "bench", *args, "--out", str(tmp / name), slowdown=slow)
        assert r.returncode == 0, f"{name}: {r.stderr[-2000:]}"
        out[name] = tmp / name
    out["tmp"] = tmp
    return out


def test_unchanged_rerun_passes(runs):
    r = _harness(runs["tmp"], "compare", str(runs["base"]), str(runs["same"]), *GATE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "REGRESSION" not in r.stdout


def test_really_slower_candidate_is_a_regression(runs):
    """REGRESSION; or, when a side's own steps were flagged unstable (CV > 10%) on this shared machine,
    INCONCLUSIVE naming it, since no change is drawn from unsteady data; the ratio is ~1/3 either way."""
    r = _harness(runs["tmp"], "compare", str(runs["base"]), str(runs["slow"]), *GATE)
    if "INCONCLUSIVE" in r.stdout:
        assert r.returncode == 0 and "unstable: CV" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode == 1, r.stdout + r.stderr
        assert "REGRESSION" in r.stdout
    ratio = float(r.stdout.splitlines()[2].split("|")[5])
    assert ratio < 0.6, r.stdout


def test_torn_tail_is_reported_and_the_complete_records_compared(runs):
    broken = runs["tmp"] / "truncated.jsonl"
    text = (runs["base"] / "records.jsonl").read_text()
    broken.write_text(text[: len(text) - 200])  # cut inside the last record, the run's only cell
    r = _harness(runs["tmp"], "compare", str(runs["base"]), str(broken), *GATE)
    # the torn tail is reported and skipped; what is left (the calibration record) holds no cell to judge
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 2 and "truncated.jsonl: line 2 is a torn write" in err[0], err
    assert "truncated.jsonl holds 1 record(s) but no cell record (kind == 'cell')" in err[1], err

"""Run many fit roles on fake process groups in one child process (``harness.fit.role_process`` with a list)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness.fit.cell import FitCell
from harness.fit.roles import rank_roles
from harness.jobs import job_env, new_tag


def run_fake_roles(cells: list[FitCell], tmp: Path, steps: int) -> dict[tuple[str, int], dict]:
    """(cell id, rank) -> that role's result, for every role of every cell (each with its cell's compute)."""
    specs = [c.role_spec(r, steps).to_dict() for c in cells for r in rank_roles(c.shape)]
    keys = [(c.cell_id, r.rank) for c in cells for r in rank_roles(c.shape)]
    spec_path, out = tmp / "specs.json", tmp / "results.json"
    spec_path.write_text(json.dumps(specs))
    subprocess.run([sys.executable, "-m", "harness.fit.role_process", "--spec", str(spec_path), "--out", str(out)],
                   check=True, env=job_env(new_tag()), timeout=900)
    return dict(zip(keys, json.loads(out.read_text())))

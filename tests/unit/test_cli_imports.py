"""The ``harness`` parent plans, launches and reports; the ranks train. The parent never imports the
parallel runtime (DTensor, FSDP, pipelining and the dynamo they pull in): ~1.5 s of every ``harness``
command (a tiny ``harness bench`` took 8.8 s before, 7.0 s after, on this 2-core machine), paid by
every invocation of CI's end-to-end tiers and by a user's every ``harness plan``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME_ONLY = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.pipelining", "torch._dynamo",
                "harness.parallel.parallelize", "harness.parallel.tp", "harness.parallel.ep",
                "harness.parallel.data_parallel", "harness.fit.role_process", "harness.run.train")


def _imported_by(module: str, names: tuple[str, ...] = RUNTIME_ONLY) -> list[str]:
    """Which of ``names`` a fresh interpreter has loaded after importing ``module``."""
    code = (f"import json, sys; import {module}; "
            f"print(json.dumps([m for m in {list(names)!r} if m in sys.modules]))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_cli_imports_no_parallel_runtime():
    assert _imported_by("harness.cli") == []


def test_the_check_sees_a_runtime_import():
    """The probe itself can fail: a module that does import the runtime is named."""
    assert "harness.parallel.parallelize" in _imported_by("harness.parallel.parallelize")
    assert "torch.distributed.fsdp" in _imported_by("harness.parallel.data_parallel")


PIPELINE_ONLY = ("torch.distributed.pipelining", "torch._dynamo", "harness.parallel.pipeline_run")


def test_a_rank_imports_torch_s_pipelining_only_for_a_pipeline():
    """Every rank imports the worker (a fork server imports it once per sweep); torch's pipelining, and the dynamo it
    pulls in, wait for a layout with a pipeline (docs/harness-cost.md, "Start-up": the worker's import 3.94 s before,
    3.45 s after, on this 2-core machine)."""
    assert _imported_by("harness.run.worker", PIPELINE_ONLY) == []
    assert importlib.util.find_spec("harness.parallel.pipeline_run"), "the probe names a module that exists"

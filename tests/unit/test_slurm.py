"""``harness slurm``: the sbatch script is valid bash and hands every node the right bench flags.

The script is also run for real, under stand-ins for ``scontrol``, ``srun`` and ``harness``: each
fake task records the argv it received, which must parse as ``harness bench`` flags describing
the same sweep, with the task's own node rank and the first node's rendezvous endpoint.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess

import pytest

from harness import cli
from harness.cli import slurm
from harness.errors import UsageError

NODES = ("gpu-a17", "gpu-b02")
JOB_ID = 4242
FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST; a long list (a big allocation) outlives `head -n 1`: SIGPIPE.
[ "$1 $2" = "show hostnames" ] || exit 64
printf '%s\\n' {nodes}
seq -f 'gpu-z%g' 1 200000
"""
FAKE_SRUN = """#!/bin/bash
# One task per node, like srun --ntasks-per-node=1; each with its own SLURM_NODEID.
while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit $?; done
"""
FAKE_HARNESS = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_OUT/argv-$SLURM_NODEID"
"""


def _parser() -> argparse.ArgumentParser:
    """The CLI parser with ``slurm`` (registered here too until cli.build_parser calls slurm.register)."""
    ap = cli.build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    if "slurm" not in sub.choices:
        slurm.register(sub)
    return ap


def _generate(argv: list[str], capsys) -> str:
    args = _parser().parse_args(["slurm", *argv])
    assert args.fn(args) == 0
    return capsys.readouterr().out


SWEEP = ["--nnodes", "2", "--gpus", "4", "--strategies", "ddp,fsdp+tp", "--sizes", "tiny", "--precision", "fp32",
         "--steps", "7", "--no-reference"]


def test_script_is_valid_bash_with_the_sbatch_header(tmp_path, capsys):
    out = tmp_path / "run dir"  # a space: quoting must hold
    script = _generate([*SWEEP, "--time", "02:30:00", "--partition", "gpu", "--out", str(out)], capsys)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert header == ["#SBATCH --job-name=harness-sweep", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                      "#SBATCH --gpus-per-node=4", "#SBATCH --time=02:30:00", "#SBATCH --partition=gpu",
                      f'#SBATCH --output="{out}/slurm-%j.out"']
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    for arg in ('--nnodes "$SLURM_NNODES"', '--node-rank "$SLURM_NODEID"', '--rdzv-endpoint "${head_node}:${port}"',
                "harness bench", "--gpus 4", "--strategies ddp,fsdp+tp"):
        assert arg in srun[0], f"{arg!r} missing from {srun[0]!r}"
    assert out.is_dir(), "sbatch needs the --output directory to exist"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_each_node_gets_its_rank_and_the_first_nodes_endpoint(tmp_path, capsys):
    out = tmp_path / "run dir"
    script = _generate([*SWEEP, "--out", str(out)], capsys)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL.format(nodes=" ".join(NODES))), ("srun", FAKE_SRUN),
                       ("harness", FAKE_HARNESS)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_OUT": str(tmp_path), "SLURM_JOB_NODELIST": "gpu-[a17,b02]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": str(JOB_ID), "SLURM_NODEID": "0"}
    run = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr

    original = cli.spec_from_args(_parser().parse_args(["slurm", *SWEEP]))
    port = slurm.PORT_BASE + JOB_ID % slurm.PORT_SPAN
    for node in range(2):
        argv = (tmp_path / f"argv-{node}").read_bytes().split(b"\0")[:-1]
        bench = _parser().parse_args([a.decode() for a in argv])
        assert bench.cmd == "bench"
        assert bench.node_rank == node, "$SLURM_NODEID must expand in each task, not in the batch shell"
        assert bench.rdzv_endpoint == f"{NODES[0]}:{port}"
        assert bench.out == out.resolve()
        assert cli.spec_from_args(bench) == original, "every node must plan the sweep that was validated"


def test_cpu_cluster_requests_no_gpus(tmp_path, capsys):
    script = _generate(["--device", "cpu", "--gpus", "2", "--out", str(tmp_path / "r")], capsys)
    assert "--gpus-per-node" not in script
    assert "--device cpu" in script


@pytest.mark.parametrize("argv,named", [
    (["--gpus", "0"], "--gpus"),
    (["--steps", "0"], "--steps"),
    (["--sizes", "huge"], "huge"),
    (["--time", "2h"], "--time"),
    (["--partition", "gpu; rm -rf /"], "--partition"),
    (["--nnodes", "0"], "--nnodes"),
])
def test_bad_input_is_a_usage_error_before_any_script_or_directory(argv, named, tmp_path, capsys):
    out = tmp_path / "run"
    args = _parser().parse_args(["slurm", *argv, "--out", str(out)])
    with pytest.raises(UsageError, match=named.replace("-", r"\-")):
        args.fn(args)
    assert capsys.readouterr().out == ""
    assert not out.exists()


def test_script_function_quotes_flags_for_the_task_shell():
    script = slurm.slurm_script(["--sweep", "/a b/s.toml", "--strategies", "ddp"], 3, 8, "90", None, "/runs/x")
    assert "#SBATCH --nodes=3" in script and "#SBATCH --gpus-per-node=8" in script and "--partition" not in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    inner = subprocess.run(["bash", "-c", 'printf "%s" ' + srun.split("bash -c ", 1)[1]], capture_output=True,
                           text=True, timeout=30).stdout
    assert inner.startswith("exec harness bench --sweep '/a b/s.toml' --strategies ddp --nnodes \"$SLURM_NNODES\"")


def test_cli_has_the_slurm_subcommand():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "slurm" in sub.choices, "harness/cli.py build_parser must call harness.cli.slurm.register(sub)"

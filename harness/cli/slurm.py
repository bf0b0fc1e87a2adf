"""``harness slurm``: write (print, or ``--submit``) an sbatch script that runs one sweep across a
Slurm job's nodes, and finishes it across requeues.

One task per node runs ``harness bench`` over the same cells in the same order; each cell is
one torchrun job spanning every node, with its rendezvous at the allocation's first node
(``$SLURM_NODEID`` 0, which is also harness node rank 0 and writes the records).
``$SLURM_NODEID`` and ``$SLURM_NNODES`` differ per task, so they are expanded inside each
task (``srun bash -c '...'``), never in the batch shell, which runs on the first node only.

A job may run more than once: Slurm requeues it (preemption, ``scontrol requeue``), the script
requeues itself when the time-limit warning (``--signal=TERM@S``) ended the sweep, or the user
resubmits ``DIR/job.sbatch``. Every attempt runs ``bench --out DIR --or-resume``, which finishes
DIR's sweep, appending to the same records, and refuses a DIR that holds another sweep.
"""

from __future__ import annotations

import argparse
import copy
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from harness.cli.arg_values import path_arg
from harness.cli.args import actions_of, add_sweep_args, spec_from_args, sweep_actions, sweep_arg_values
from harness.cli.bench import add_run_args
from harness.errors import UsageError
from harness.planner import expand
from harness.records.atomic import write_text_atomic
from harness.records.record import new_run_id
from harness.run.rundir import check_same_sweep, holds_records

SLURM_TIME = re.compile(r"(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE)")
"""sbatch ``--time`` formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
PARTITION = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")
MAX_WARN_S = 65535
"""sbatch ``--signal=SIG@TIME``: TIME is 0-65535 seconds."""
SCRIPT_NAME = "job.sbatch"
"""The script, kept in the run directory: resubmitting it finishes the sweep."""
PORT_BASE, PORT_SPAN = 20000, 20000
"""Rendezvous port = PORT_BASE + job id mod PORT_SPAN: fixed within a job, varied across jobs."""


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch header asks of the scheduler, and how the job survives it."""

    nnodes: int
    gpus_per_node: int  # 0: a CPU cluster, no GPU requested
    time_limit: str = "01:00:00"
    partition: str | None = None
    warn_s: int = 120
    """Seconds before the time limit at which Slurm sends the tasks SIGTERM (``--signal=TERM@warn_s``)."""
    max_restarts: int = 3
    """Requeues the script asks for after a SIGTERM-ended sweep (Slurm's ``MaxBatchRequeue`` also caps them)."""

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise UsageError(f"--nnodes ({self.nnodes}) must be >= 1")
        if not SLURM_TIME.fullmatch(self.time_limit):
            raise UsageError(f"--time {self.time_limit!r}: use a Slurm time limit such as 90, 01:30:00 or 1-12:00:00")
        if self.partition is not None and not PARTITION.fullmatch(self.partition):
            raise UsageError(f"--partition {self.partition!r}: expected a partition name (letters, digits, _ . -), "
                             f"or several separated by commas")
        if not 1 <= self.warn_s <= MAX_WARN_S:
            raise UsageError(f"--warn-before {self.warn_s}: must be 1-{MAX_WARN_S} seconds (sbatch --signal's range)")
        limit = time_limit_s(self.time_limit)
        if limit is not None and self.warn_s >= limit:
            raise UsageError(f"--warn-before {self.warn_s} s is not before the end of --time {self.time_limit} "
                             f"({limit} s); warn earlier than the limit, or ask for more --time")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts {self.max_restarts}: must be >= 0 (0: never requeue)")


def time_limit_s(value: str) -> int | None:
    """Seconds in an sbatch ``--time`` (None for UNLIMITED/INFINITE): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    if value in ("UNLIMITED", "INFINITE"):
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-H[:M[:S]]
        h, m, sec = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + sec
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def slurm_script(spec_args: list[str], job: SlurmJob, out: str) -> str:
    """The sbatch script. ``spec_args`` are the sweep flags (without ``--nnodes``), passed verbatim
    to every node's ``harness bench``, which starts ``out`` or, on a requeue or resubmission of the
    same job, finishes it (``--or-resume``)."""
    bench = ["harness", "bench", *spec_args]
    # Quoted for the task's shell; the $SLURM_* and rendezvous variables stay unexpanded until then.
    task = (" ".join(shlex.quote(a) for a in bench)
            + ' --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --rdzv-endpoint "${head_addr}:${port}"'
            + f" --out {shlex.quote(out)} --or-resume")
    resubmit = shlex.quote(f"resubmit to finish the sweep: sbatch {out}/{SCRIPT_NAME}")
    lines = [
        "#!/bin/bash",
        "#SBATCH --job-name=harness-sweep",
        f"#SBATCH --nodes={job.nnodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if job.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    lines.append(f"#SBATCH --time={job.time_limit}")
    if job.partition is not None:
        lines.append(f"#SBATCH --partition={job.partition}")
    lines += [
        f"#SBATCH --output={_sbatch_value(out + '/slurm-%j.out')}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=TERM@{job.warn_s}",
        "#SBATCH --requeue",
        "# Generated by `harness slurm`; `harness` must be on PATH on every node (e.g. submit from",
        "# the activated virtual environment: sbatch exports the submitting environment).",
        "# --signal: SIGTERM reaches the tasks before the time limit; each harness ends its running cell",
        "# (unrecorded) and exits 143, and this script requeues the job, which finishes the sweep",
        "# (--or-resume). --requeue lets Slurm requeue it too (preemption, a failed node).",
        "set -eu  # no pipefail: head exiting early may SIGPIPE scontrol, which is fine",
        "",
        'echo "harness job $SLURM_JOB_ID: attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on $SLURM_JOB_NODELIST, '
        '$(date -u +%Y-%m-%dT%H:%M:%SZ)"',
        "# The allocation's first node ($SLURM_NODEID 0) hosts every cell's rendezvous, at the address",
        "# Slurm reaches it by (its NodeAddr), or its name when scontrol gives none.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        '[ -n "$head_node" ] || { echo "harness: no node list from scontrol" >&2; exit 1; }',
        "head_addr=$(scontrol show node -o \"$head_node\" 2>/dev/null | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')",
        'head_addr=${head_addr:-$head_node}',
        f"port=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))",
        "export head_addr port",
        "",
        "# One harness per node, all walking the same cells; node rank 0 writes the records. A node",
        "# that exits non-zero (a failed cell) must not kill the others: --kill-on-bad-exit=0.",
        "rc=0",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c {shlex.quote('exec ' + task)} || rc=$?",
        'if [ "$rc" -eq 143 ]; then',
        "    restarts=${SLURM_RESTART_COUNT:-0}",
        f'    if [ "$restarts" -lt {job.max_restarts} ]; then',
        f'        echo "harness job: the sweep stopped on SIGTERM; requeueing (restart $(( restarts + 1 )) of '
        f'{job.max_restarts})"',
        '        scontrol requeue "$SLURM_JOB_ID" || echo "harness job: scontrol requeue failed (exit $?); "'
        f"{resubmit} >&2",
        "    else",
        f'        echo "harness job: the sweep stopped on SIGTERM after {job.max_restarts} restarts; "{resubmit} >&2',
        "    fi",
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def _sbatch_value(value: str) -> str:
    """An ``#SBATCH`` option value: sbatch (not a shell) parses these lines and knows only double quotes."""
    if re.search(r'["\\\n]', value):
        raise UsageError(f"--out {value!r}: a path with a double quote, backslash or newline cannot go into "
                         f"#SBATCH --output; choose a plainer path")
    return f'"{value}"' if re.search(r"\s", value) else value


def sweep_flags(args: argparse.Namespace, skip: tuple[str, ...] = ("nnodes",)) -> list[str]:
    """The sweep flags and bench's run flags set in ``args`` (defaults left out), as command-line
    arguments (a sweep file as an absolute path)."""
    flags: list[str] = []
    for action in [*sweep_actions(), *actions_of(add_run_args)]:
        value = getattr(args, action.dest, None)
        if value is None or value == action.default or action.dest in skip:
            continue
        option = action.option_strings[0]
        if action.nargs == 0:  # store_true
            flags += [option]
        else:
            flags += [option, str(value.resolve()) if isinstance(value, Path) else str(value)]
    return flags


def cmd_slurm(args: argparse.Namespace) -> int:
    target = args.device or "auto"
    checked = copy.copy(args)
    if target == "cuda":
        checked.device = None  # the submitting (login) node need not have a GPU; the job's nodes do
    spec = spec_from_args(checked)
    if target != "cpu":
        spec = replace(spec, device_kind="cuda")  # validate cells for the GPU nodes the job requests
    cells = expand(spec)
    if not any(c.valid for c in cells):
        raise UsageError("no valid cell to run: " + "; ".join(f"{c.cell_id}: {c.reason}" for c in cells))
    job = SlurmJob(nnodes=spec.nnodes, gpus_per_node=0 if target == "cpu" else max(spec.gpus),
                   time_limit=args.time, partition=args.partition, warn_s=args.warn_before,
                   max_restarts=args.max_restarts)
    sbatch = shutil.which("sbatch") if args.submit else None
    if args.submit and sbatch is None:
        raise UsageError("--submit: no sbatch on PATH (submit from a Slurm login node); or drop --submit and "
                         "submit the printed script yourself")
    out = (args.out or Path("results") / new_run_id()).resolve()
    if holds_records(out):  # a resubmission finishes its own sweep; another sweep's directory fails now, not in the job
        check_same_sweep(out, {**sweep_arg_values(args), "nnodes": str(spec.nnodes)})
    script = slurm_script(sweep_flags(args), job, str(out))
    out.mkdir(parents=True, exist_ok=True)  # sbatch does not create the directory of --output
    path = write_text_atomic(out / SCRIPT_NAME, script)
    if sbatch is None:
        print(script, end="")
        return 0
    return _submit(sbatch, path, out)


def _submit(sbatch: str, path: Path, out: Path) -> int:
    """``sbatch --parsable`` the script; print the job id, the run directory and how to follow it."""
    try:
        done = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        print(f"harness slurm: sbatch gave no answer in 120 s (is slurmctld up? sinfo); nothing submitted that "
              f"we know of: check squeue, then sbatch {path}", file=sys.stderr)
        return 1
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip() or "no message").splitlines()[-1]
        print(f"harness slurm: sbatch refused {path} (exit {done.returncode}): {why}", file=sys.stderr)
        return 1
    job_id = done.stdout.strip().split(";")[0]  # "id" or "id;cluster"
    q = shlex.quote
    print(f"submitted job {job_id}: run directory {out}\n"
          f"follow:  tail -f {q(f'{out}/slurm-{job_id}.out')}   (squeue -j {job_id}; "
          f"harness report {q(str(out))} reads the records written so far)\n"
          f"again:   sbatch {q(str(path))} finishes the same sweep after a cancel or a time limit")
    return 0


def register(sub) -> None:
    """Add ``harness slurm`` to the CLI's subparsers."""
    s = sub.add_parser("slurm", help="print (or --submit) an sbatch script running the sweep on --nnodes Slurm nodes")
    add_sweep_args(s)
    add_run_args(s)
    s.add_argument("--time", default="01:00:00", help="Slurm time limit, e.g. 90, 01:30:00, 1-12:00:00")
    s.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    s.add_argument("--out", type=path_arg, help="run directory on a filesystem every node sees (default results/<run-id>); "
                                            "the script is kept there as job.sbatch")
    s.add_argument("--warn-before", type=int, default=120, metavar="S",
                   help="seconds before the time limit at which the harness gets SIGTERM, ends its cell and the job "
                        "requeues itself (default 120; Slurm may signal up to a minute early)")
    s.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="times the job requeues itself after a SIGTERM-ended sweep (default 3; 0: never)")
    s.add_argument("--submit", action="store_true",
                   help="submit with sbatch and print the job id, the run directory and how to follow it")
    s.set_defaults(fn=cmd_slurm)

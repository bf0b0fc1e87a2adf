"""Every kind of bad input issue 60 found, as a table: the input, the exit status and the one line it gets.

Each case is (kind, files to write, the command, exit status, a fragment of the one stderr line). The command runs
in-process (``harness.cli.main``) in a folder of its own with a calibration store of its own; nothing is launched
and a refused ``bench`` writes nothing. ``scripts/door_table.py`` prints this table with the lines as they are
(docs/bad-input.md holds its output).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.cli import main
from harness.records.record import make_record


def record(cell_id: str = "tiny-single-fp32-w1-gb8-strong", **fields) -> dict:
    """One cell record as the sweep writes it (docs/records.md), with ``fields`` replaced."""
    r = make_record(run_id="20261206-000000-abcd", cell_id=cell_id, status="ok", config={"size": "tiny"}, env={},
                    degrees=None, workload={"name": "tiny"},
                    metrics={"tokens_per_step": 1024, "tokens_per_s_per_device": 1000.0},
                    samples={"step_time_s": [0.1, 0.11, 0.1]})
    return {**r, **fields}


def lines(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


GOOD = lines(record())
SWEEP_ARGS = json.dumps({"gpus": "1", "sizes": "tiny", "strategies": "single", "device": "cpu"})


@dataclass(frozen=True)
class Case:
    kind: str
    argv: tuple[str, ...]
    line: str
    """A fragment of the one line on stderr."""
    files: dict[str, str | bytes] = field(default_factory=dict)
    rc: int = 2
    leaves: frozenset[str] = frozenset()
    """What the refusal may leave: the run folder's lock, taken before its records are looked at (two runs started
    at once into one --out cannot both find it empty)."""


CASES = [
    # Files that are not text
    Case("not text", ("plan", "--device", "cpu", "--sweep", "sweep.toml"), "sweep.toml: not UTF-8 text (byte 9)",
         {"sweep.toml": b'sizes = "\xff\xfe"\n'}),
    Case("not text", ("plan", "--device", "dev.toml", "--gpus", "8", "--arch", "llama3", "--sizes", "8b",
                      "--strategies", "fsdp"), "--device dev.toml: not UTF-8 text (byte 0)", {"dev.toml": b"\xff\n"}),
    # Damaged records
    Case("damaged records", ("report", "run"), "line 1 is not a record this harness reads (metrics = [1, 2] is not "
         "dict)", {"run/records.jsonl": lines(record(metrics=[1, 2]))}),
    Case("damaged records", ("compare", "run", "good"), "line 1 is not a record this harness reads (metrics = 'fast' "
         "is not dict)", {"run/records.jsonl": lines(record(metrics="fast")), "good/records.jsonl": GOOD}),
    Case("damaged records", ("diff", "good", "run"), "(metrics.step_time_s = 'slow' is not dict[str, float])",
         {"run/records.jsonl": lines(record(metrics={"step_time_s": "slow"})), "good/records.jsonl": GOOD}),
    Case("damaged records", ("history", "good", "run"), "(metrics = None is not dict)",
         {"run/records.jsonl": lines(record(metrics=None)), "good/records.jsonl": GOOD}),
    Case("damaged records", ("report", "run"), "line 2 is not a record this harness reads (no schema_version: not a "
         "harness record", {"run/records.jsonl": lines(record(), {"hello": "world"})}),
    Case("damaged records", ("report", "run"), "(schema_version 2: this harness reads version 1; read the run with "
         "the harness version that wrote it)", {"run/records.jsonl": lines(record(schema_version=2))}),
    Case("damaged records", ("diff", "good", "run"), "(status 'fine' is not one of ok, oom, timeout, crashed, invalid, contradicted)",
         {"run/records.jsonl": lines(record(status="fine")), "good/records.jsonl": GOOD}),
    Case("damaged records", ("bench", "--resume", "run"), "(schema_version 0: this harness reads version 1",
         {"run/records.jsonl": lines(record(schema_version=0)), "run/sweep_args.json": SWEEP_ARGS}),
    Case("damaged records", ("history", "good", "run"), "run/records.jsonl is empty: nothing was measured",
         {"run/records.jsonl": "", "good/records.jsonl": GOOD}),
    Case("damaged records", ("compare", "good", "run"), "run/records.jsonl is empty: nothing was measured",
         {"run/records.jsonl": "", "good/records.jsonl": GOOD}),
    # Numbers that pass "> 0" but are not numbers
    Case("not a number", ("bench", "--device", "cpu", "--base-lr", "nan", "--out", "out"),
         "--base-lr 'nan': not a finite number; expected a number > 0"),
    Case("not a number", ("plan", "--device", "cpu", "--target-loss", "inf"), "--target-loss 'inf': not a finite "
         "number"),
    Case("not a number", ("bench", "--device", "cpu", "--mem-cap-gib", "inf", "--out", "out"),
         "--mem-cap-gib 'inf': not a finite number"),
    Case("not a number", ("plan", "--device", "h100", "--device-mem", "nan", "--gpus", "8", "--arch", "llama3",
                          "--sizes", "8b"), "--device-mem 'nan': not a finite number"),
    Case("not a number", ("plan", "--device", "dev.toml", "--gpus", "8", "--arch", "llama3", "--sizes", "8b"),
         "dev.toml: hbm_gib = inf must be a finite number > 0", {"dev.toml": 'base = "h100"\nhbm_gib = inf\n'}),
    Case("not a number", ("plan", "--device", "dev.toml", "--gpus", "8", "--arch", "llama3", "--sizes", "8b"),
         "dev.toml: op_rates.gemm_tflops.bf16 = nan must be a finite number > 0",
         {"dev.toml": 'base = "h100"\n[op_rates]\ngemm_tflops = { bf16 = nan }\n'}),
    Case("not a number", ("bench", "--device", "cpu", "--sweep", "sweep.toml", "--out", "out"),
         "sweep.toml: base_lr 'nan': not a finite number", {"sweep.toml": "base_lr = nan\n"}),
    Case("not a number", ("plan", "--device", "cpu", "--sweep", "sweep.toml"),
         "sweep.toml: warmup_steps 'True': must be an integer >= 0", {"sweep.toml": 'warmup_steps = "True"\n'}),
    # Empty or loosely typed values
    Case("empty or loose", ("plan", "--device", "cpu", "--sizes", ""), "--sizes '' is empty: it would sweep nothing"),
    Case("empty or loose", ("bench", "--device", "cpu", "--strategies", " , ", "--out", "out"),
         "--strategies ' , ' is empty: it would sweep nothing"),
    Case("empty or loose", ("bench", "--device", "cpu", "--out", ""), "argument --out: '' is an empty path"),
    Case("empty or loose", ("plan", "--device", "cpu", "--sweep", "sweep.toml"),
         "sweep.toml: force = 'yes' is an on/off switch; write force = true or force = false",
         {"sweep.toml": 'force = "yes"\n'}),
    Case("empty or loose", ("plan", "--device", "cpu", "--sweep", "sweep.toml"),
         "sweep.toml: no_reference = 'no' is an on/off switch", {"sweep.toml": 'no_reference = "no"\n'}),
    Case("empty or loose", ("plan", "--device", "cpu", "--sweep", "sweep.toml"),
         "sweep.toml: compile = True: give a value or a flat list of values", {"sweep.toml": "compile = true\n"}),
    Case("empty or loose", ("plan", "--device", "cpu", "--gpus", "2", "--strategies", "ddp", "--pp-schedule",
                            "gpipe"), "--pp-schedule 'gpipe': no strategy of this sweep (ddp) has a pipeline"),
    Case("empty or loose", ("plan", "--device", "cpu", "--gpus", "2", "--strategies", "pp", "--pp-schedule", "zb",
                            "--ac", "op"), "--pp-schedule zb with --ac op: torch's zero-bubble schedules run each "
         "backward twice (input, then weight) and its selective checkpointing allows one"),
    Case("empty or loose", ("plan", "--device", "cpu", "--gpus", "2", "--strategies", "fsdp", "--sp", "off"),
         "--sp 'off': no strategy of this sweep (fsdp) has tensor parallel"),
    Case("empty or loose", ("plan", "--device", "cpu", "--fp8-recipe", "rowwise"),
         "--fp8-recipe 'rowwise' sets up --precision fp8, and this sweep's precisions are fp32"),
    Case("empty or loose", ("plan", "--device", "cpu", "--checkpoint-every", "2"),
         "--checkpoint-every '2': --checkpoint is off, so nothing is saved"),
    Case("empty or loose", ("plan", "--device", "cpu", "--gpus", "2", "--degrees", "tp=²"),
         "--degrees 'tp=²': expected name=int pairs"),
    # Resume that guesses
    Case("resume guesses", ("bench", "--resume", "run"), "--resume run: the run recorded no sweep flags "
         "(sweep_args.json), so its cells cannot be known", {"run/records.jsonl": ""}),
    Case("resume guesses", ("bench", "--resume", "run"), "--resume run: the run recorded no sweep flags",
         {"run/records.jsonl": GOOD}),
    Case("resume guesses", ("bench", "--resume", "run", "--gpus", "2"), "--resume run with flags that change its "
         "sweep (--gpus '2' here, '1' there); a resumed run finishes its own sweep: harness bench --resume run",
         {"run/records.jsonl": GOOD, "run/sweep_args.json": SWEEP_ARGS}),
    Case("resume guesses", ("bench", "--resume", "nowhere"), "--resume nowhere: no records.jsonl there, so there is "
         "no run to finish; start one with harness bench --out nowhere"),
    Case("resume guesses", ("bench", "--device", "cpu", "--out", "run"), "--out run already holds records; pass a "
         "new --out", {"run/records.jsonl": GOOD},
         leaves=frozenset({"run/.harness.lock"})),
    # The same mistake, one answer
    Case("one answer", ("fit", "--device", "cpu", "--gpus", "1", "--strategies", "single", "--out", "afile"),
         "--out afile is not writable", {"afile": "x"}),
    Case("one answer", ("fit", "--device", "cpu", "--gpus", "1", "--strategies", "single", "--out", "afile/run"),
         "--out afile/run is not writable (Not a directory)", {"afile": "x"}),
    Case("one answer", ("plan", "--device", "cpu"), "store.json is not valid JSON (Expecting property name",
         {"store.json": "{torn"}),
    Case("one answer", ("plan", "--device", "cpu"), "store.json is not a JSON object of calibration entries; "
         "move it aside to re-measure", {"store.json": "[1, 2]"}),
    # Messages that point at the right thing
    Case("names the file", ("plan", "--device", "dev.toml", "--gpus", "8", "--arch", "llama3", "--sizes", "8b"),
         "dev.toml: power_cap_w = 900 W is above tdp_w = 700 W", {"dev.toml": 'base = "h100"\npower_cap_w = 900\n'}),
    Case("names the file", ("plan", "--device", "dev.toml", "--gpus", "8", "--arch", "llama3", "--sizes", "8b",
                            "--precision", "bf16"), "or give bf16 = <TFLOP/s> under [peak_tflops] in dev.toml",
         {"dev.toml": 'base = "h100"\n[peak_tflops]\nfp8 = 1000\n'}),
    Case("names the file", ("plan", "--device", "dev.toml", "--gpus", "8"), "dev.toml: base = 'hopper' is not a "
         "preset; choose from h100", {"dev.toml": 'base = "hopper"\n'}),
]


def write_files(case: Case, where: Path) -> None:
    for name, content in case.files.items():
        path = where / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


def run_case(case: Case, where: Path, capsys) -> tuple[int, list[str]]:
    """Run the case's command in ``where`` (its files written); its exit status and stderr lines."""
    before = os.getcwd()
    os.chdir(where)
    try:
        try:
            rc = main(list(case.argv))
        except SystemExit as e:  # argparse's refusals
            rc = int(e.code or 0)
    finally:
        os.chdir(before)
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def door(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    monkeypatch.setenv("HARNESS_CALIBRATION", str(tmp_path / "store.json"))
    return tmp_path


@pytest.mark.parametrize("case", CASES, ids=[f"{i:02d}-{c.kind}" for i, c in enumerate(CASES)])
def test_refused_at_the_door_with_one_line(case: Case, door: Path, capsys) -> None:
    write_files(case, door)
    before = {p.relative_to(door) for p in door.rglob("*")}
    rc, err = run_case(case, door, capsys)
    assert rc == case.rc, err
    assert len(err) == 1 and case.line in err[0], err
    assert "Traceback" not in err[0]
    assert {p.relative_to(door) for p in door.rglob("*")} - before <= {Path("store.json.lock"), *map(Path, case.leaves)}, \
        "nothing may be written for bad input"


def test_a_sweep_of_only_the_parity_reference_is_refused() -> None:
    """A sweep whose only cell is the parity reference plans nothing the user asked for: refused, never a run of 0."""
    from harness.cli.bench import check_valid_any
    from harness.errors import UsageError
    from harness.planner import expand
    from harness.spec import SweepSpec

    reference = [c for c in expand(SweepSpec(sizes=("tiny",), strategies=("ddp",), precisions=("fp32",), gpus=(2,),
                                          device_kind="cpu", batch=4, steps=2, warmup=1))
                 if c.reference_only]
    assert reference, "a multi-rank sweep plans its single-device parity reference"
    with pytest.raises(UsageError, match="the sweep plans no cell"):
        check_valid_any(reference)

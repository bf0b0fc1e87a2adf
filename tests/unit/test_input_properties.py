"""Every input checked at the door (issue 60): property-based tests (Hypothesis) that arbitrary input to the
harness's readers never ends in a Python traceback.

Each reader either returns normally or raises :class:`harness.errors.UsageError` (the CLI prints it as one line and
exits 2); argparse's own ``SystemExit(2)`` for a malformed command line is a clean refusal too. What a reader
returns is held to the same standard: a number it accepted is finite (and positive where it is a rate or a size).

Targets, one test each; the examples per run are in :data:`EXAMPLES` (cli_flags 600, sweep_bytes 600, sweep_toml
500, device_file 500, records 40, each on top of its ``@example`` inputs: the whole file runs in about 30 s on 2 CPU
cores when every example passes):

* ``cli_flags``: ``harness plan --device cpu`` with 1 to 3 sweep flags of odd values (text, ``nan``, ``inf``,
  ``1e400``, ``-0``, empty lists, ...), through :func:`harness.cli.spec_from_args` and
  :func:`harness.planner.expand`;
* ``sweep_bytes`` and ``sweep_toml``: a sweep file (arbitrary bytes, non-UTF-8 included, and arbitrary text; then
  well-formed TOML of the sweep keys with odd values, tables and arrays of tables) through
  :func:`harness.cli.args._read_sweep_file`, and where it reads, ``plan --sweep FILE`` as above;
* ``device_file``: a device file (raw bytes; well-formed TOML of its keys, mostly good values and one or two odd
  ones) through :func:`harness.model.device_file.device_from_file`, ``device_arg`` with odd ``--device-mem`` and
  ``--power-cap``, and, where it reads, ``harness plan --device FILE`` (a what-if priced op by op);
* ``records``: a records.jsonl of valid, mistyped, non-object, broken, non-UTF-8, blank and torn lines through
  :func:`harness.records.reader.read_records`, ``load_records``, ``RunFrames.of``, ``compare``, and
  ``harness report``, ``diff``, ``history`` and ``compare`` (:func:`harness.cli.main`: an exit code, never a raise).

The inputs the issue names, and every failure found so far, are ``@example``s: they run on every run, before the
random ones. No example database is kept (``database=None``); each example writes under pytest's temporary folder,
and the only thing written in the checkout is Hypothesis's own cache, ``.hypothesis/`` (git ignores it by the
``.gitignore`` inside it).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from harness.cli import build_parser, main, spec_from_args
from harness.cli.args import SP_MODES, _read_sweep_file, sweep_actions
from harness.compare.stats import CompareOptions
from harness.compare.verdicts import compare
from harness.errors import UsageError
from harness.model.device_file import FILE_KEYS, device_arg, device_from_file
from harness.model.device_rates import RATE_KEYS
from harness.model.hardware import DEVICES, Device
from harness.model.op_cost import OpRates
from harness.parallel.levers import COMPILE_MODES, OPTIMIZERS
from harness.parallel.presets import STRATEGIES
from harness.parallel.schedules import PP_SCHEDULES
from harness.planner import expand
from harness.precision import FP8_RECIPES, PRECISIONS
from harness.records.reader import load_records, read_records
from harness.records.record import make_record
from harness.report.run_frames import RunFrames
from harness.spec import CHECKPOINT_MODES, SweepSpec
from workloads.moe import ROUTINGS
from workloads.sizes import ARCHS, FAMILIES

EXAMPLES = {"cli_flags": 600, "sweep_bytes": 600, "sweep_toml": 500, "device_file": 500, "records": 40}
"""Hypothesis examples per target and run (the ``@example`` inputs run on top of these)."""


def _settings(target: str) -> settings:
    return settings(max_examples=EXAMPLES[target], deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """One folder for the module; each example writes in a fresh folder under it (a function-scoped ``tmp_path``
    would be shared by every example of a test)."""
    return tmp_path_factory.mktemp("input-properties")


@contextlib.contextmanager
def scratch(root: Path) -> Iterator[Path]:
    """A fresh folder for one example, removed after it."""
    path = Path(tempfile.mkdtemp(dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def refused_or(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
    """``(True, value)`` where ``fn`` returned, ``(False, None)`` where it refused with a UsageError; any other
    exception is the failure this file looks for, and propagates."""
    try:
        value = fn(*args, **kwargs)
    except UsageError as e:
        assert str(e).strip(), f"{fn.__name__}: a UsageError without a message"
        event(f"{fn.__name__}: UsageError")
        return False, None
    event(f"{fn.__name__}: returned")
    return True, value


def parsed(argv: list[str]):
    """The parsed command line, or None where argparse refused it (``SystemExit(2)``, its usage line on stderr)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return _parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 2, f"argparse exited {e.code!r} for {argv!r}"
        event("argparse: exit 2")
        return None


@functools.cache
def _parser():
    return build_parser()


def run_main(argv: list[str], codes: tuple[int, ...]) -> int:
    """``harness ARGV`` with its output captured: an exit code in ``codes``, or argparse's SystemExit(2); any other
    exception escapes ``main`` and fails the test."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as e:
        assert e.code == 2, f"harness {' '.join(argv)}: SystemExit({e.code!r}); stderr: {err.getvalue()}"
        return 2
    assert code in codes, f"harness {' '.join(argv)}: exit {code!r}, expected one of {codes}; stderr: {err.getvalue()}"
    if code == 2:
        assert err.getvalue().strip(), f"harness {' '.join(argv)}: exit 2 without a word on stderr"
    event(f"harness {argv[0]}: exit {code}")
    return code


def finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def check_spec(spec: SweepSpec) -> None:
    """What a sweep accepted: each number a finite one."""
    for name in ("base_lr", "target_loss", "mem_cap_gib", "monitor_hz"):
        value = getattr(spec, name)
        assert value is None or finite(value), f"spec.{name} = {value!r} accepted"
    for name in ("base_lr", "target_loss", "mem_cap_gib"):
        value = getattr(spec, name)
        assert value is None or value > 0, f"spec.{name} = {value!r} accepted"


def plan(argv: list[str]) -> None:
    """``harness plan ARGV``'s input path: parse, the spec, the planned cells; each step returns or refuses."""
    args = parsed(argv)
    if args is None:
        return
    ok, spec = refused_or(spec_from_args, args)
    if not ok:
        return
    check_spec(spec)
    refused_or(expand, spec)


# ---------------------------------------------------------------- values

NAN, INF = math.nan, math.inf
NUMBER_TEXTS = ("nan", "NaN", "-nan", "inf", "-inf", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", "-0",
                "-0.0", "", " ", ",", "1,,2", ",1", "0", "00", "-1", "1", "2", "1.5", "0.0", "+1", " 1 ", "1_000",
                "0x10", "1e3", "\u0661", "\u00b2", "9" * 30, "-", "true", "on", "auto")
"""Numbers as text, and the texts that only look like numbers (an Arabic-Indic one, a superscript two)."""
SIZE_NAMES = tuple(dict.fromkeys(name for arch in ARCHS for name in FAMILIES[arch]))
WORDS = (*STRATEGIES, *PRECISIONS, *ARCHS, *SIZE_NAMES, *PP_SCHEDULES, *COMPILE_MODES, *OPTIMIZERS, *ROUTINGS,
         *CHECKPOINT_MODES, *FP8_RECIPES, "auto", "cpu", "cuda", "h100", "strong", "weak", "none", "linear", "sqrt",
         "attn", "op", "full", "layer2", "layer0", "layer-1", "pp=2", "tp=2,pp=2", "tp=0", "pp=-1", "=2", "pp=",
         "x=1", "1,2,4", "1,2")
"""Values a flag takes, and near misses: each flag's valid words, to get past the first check to the next."""
PLAIN_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)
"""A command line's text: anything but NUL (which no argv can hold); a non-UTF-8 argv's surrogates are examples."""
FLAG_VALUES = st.one_of(
    st.sampled_from(NUMBER_TEXTS), st.sampled_from(WORDS),
    st.lists(st.sampled_from((*WORDS, *NUMBER_TEXTS)), min_size=1, max_size=3).map(",".join),
    st.integers().map(str), st.floats().map(str), st.floats().map(repr), PLAIN_TEXT)
SAFE_MODELS = ("", ",", " ", ", ,", "no/such/config.json", "no-such-folder", "no_such_module_xyz:factory")
"""``--model`` values that read nothing and import nothing: a factory text names a module to import and a function
to call, so an arbitrary one is no input for a test to feed."""

KNOWN = {a.dest for a in sweep_actions()} - {"sweep"}
"""The keys a sweep file may hold (as ``merged`` reads one for ``harness bench``)."""


def _good_sweep_values() -> dict[str, st.SearchStrategy]:
    """A value each sweep key takes, so that a file of them plans and its odd values are checked one by one."""
    def words(*values: str, most: int = 2) -> st.SearchStrategy:
        return st.one_of(st.sampled_from(values), st.lists(st.sampled_from(values), min_size=1, max_size=most,
                                                           unique=True))

    count = st.integers(1, 4)
    by_key: dict[str, st.SearchStrategy] = {
        "gpus": st.one_of(count, words("1", "2", "4")), "sizes": words("tiny", "mini"), "arch": words(*ARCHS),
        "moe_routing": words(*ROUTINGS), "strategies": words(*STRATEGIES), "precision": words("fp32", "bf16", "fp8"),
        "sp": words(*SP_MODES), "fp8_recipe": words(*FP8_RECIPES), "fp8_all_gather": words(*COMPILE_MODES),
        "scaling": words("strong", "weak"), "lr_rule": words("none", "linear", "sqrt"),
        "batch": st.one_of(st.integers(1, 64), st.just("auto")), "seq_len": st.one_of(st.integers(16, 256),
                                                                                     words("64", "128")),
        "steps": count, "warmup": st.integers(0, 3), "microbatches": count, "pp_schedule": words(*PP_SCHEDULES),
        "grad_accum": count, "base_lr": st.floats(1e-5, 1.0), "base_batch": st.integers(1, 64),
        "warmup_steps": st.integers(0, 10), "seed": st.integers(0, 99), "target_loss": st.floats(0.1, 10.0),
        "degrees": st.sampled_from(("pp=2", "tp=2", "dp_shard=2", "pp=2,tp=2")), "compile": words(*COMPILE_MODES),
        "ac": words("none", "attn", "op", "full", "layer2"), "optimizer": words(*OPTIMIZERS),
        "checkpoint": words(*CHECKPOINT_MODES), "checkpoint_every": count, "restore_from": st.just("no/such/step"),
        "device": st.sampled_from(("cpu", "auto")), "nvtx": st.sampled_from(("on", "off")),
        "monitor_hz": st.one_of(st.integers(0, 1000), st.floats(0.0, 1000.0)), "mem_cap_gib": st.floats(0.5, 64.0),
        "nnodes": st.integers(1, 2), "model": st.sampled_from(SAFE_MODELS),
        **{a.dest: st.booleans() for a in sweep_actions() if a.nargs == 0},
    }
    assert set(by_key) == KNOWN, f"sweep keys without a value here: {KNOWN ^ set(by_key)}"
    return by_key


GOOD_SWEEP = _good_sweep_values()


_ACTIONS = [a for a in sweep_actions() if a.dest not in ("sweep", "model")]
VALUE_FLAGS = {a.option_strings[0]: a.dest for a in _ACTIONS if a.nargs != 0}
SWITCH_FLAGS = tuple(a.option_strings[0] for a in _ACTIONS if a.nargs == 0)


def as_flag_text(value: Any) -> str:
    """A sweep file's value as a flag gives it: a list as a comma list."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


@st.composite
def flag_args(draw) -> list[str]:
    """One sweep flag on a command line: a switch, or a flag and its value (a good one or an odd one) as two words
    or as ``--flag=value``."""
    kind = draw(st.sampled_from(("value", "value", "value", "switch", "model")))
    if kind == "switch":
        return [draw(st.sampled_from(SWITCH_FLAGS))]
    if kind == "model":
        flag, value = "--model", draw(st.sampled_from(SAFE_MODELS))
    else:
        flag = draw(st.sampled_from(sorted(VALUE_FLAGS)))
        value = draw(st.one_of(GOOD_SWEEP[VALUE_FLAGS[flag]].map(as_flag_text), FLAG_VALUES))
    return [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]


# ---------------------------------------------------------------- TOML


class Raw(str):
    """A TOML literal written as is (``1e400``, ``+inf``, ``0x10``)."""


class Table(dict):
    """A ``[key]`` section of a document (nested in a value: an inline table)."""


class TableArray(list):
    """An array of tables: ``[[key]]`` sections."""


def toml_string(s: str) -> str:
    escaped = []
    for ch in s:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif (ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F:
            escaped.append(f"\\u{ord(ch):04x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else toml_string(k)


def toml_value(v: Any) -> str:
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML for {v!r}")


def toml_document(doc: dict[str, Any]) -> str:
    """``doc`` as TOML: its plain values first, then its :class:`Table` and :class:`TableArray` values as sections."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, Table | TableArray)]
    for k, v in doc.items():
        if isinstance(v, Table):
            lines += ["", f"[{toml_key(k)}]", *(f"{toml_key(str(kk))} = {toml_value(x)}" for kk, x in v.items())]
        elif isinstance(v, TableArray):
            for t in v:
                lines += ["", f"[[{toml_key(k)}]]", *(f"{toml_key(str(kk))} = {toml_value(x)}" for kk, x in t.items())]
    return "\n".join(lines) + "\n"


RAW_LITERALS = ("1e400", "-1e400", "+inf", "-inf", "+nan", "-nan", "0x10", "0o7", "0b1", "1_000", "-0", "+0.0",
                "1979-05-27", "07:32:00", "1979-05-27T07:32:00Z", "'literal'", '""', "[]", "{}")
ODD_NUMBERS = st.one_of(
    st.sampled_from((NAN, INF, -INF, 0, 0.0, -0.0, -1, -1.5, 1e308, 5e-324, 10**30, 2**63, -(2**63))),
    st.integers(), st.floats())
SCALARS = st.one_of(ODD_NUMBERS, st.booleans(), st.text(max_size=12), st.sampled_from(RAW_LITERALS).map(Raw),
                    st.sampled_from(WORDS), st.sampled_from(NUMBER_TEXTS))
NESTED = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=6)
TABLES = st.dictionaries(st.text(max_size=6), NESTED, max_size=3)


def sections(values: st.SearchStrategy) -> st.SearchStrategy:
    """Values, and the tables and arrays of tables where a value belongs."""
    return st.one_of(values, TABLES.map(Table), st.lists(TABLES, min_size=1, max_size=2).map(TableArray))


def write(root: Path, name: str, data: bytes) -> Path:
    path = root / name
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------- 1. CLI sweep flags


@_settings("cli_flags")
@given(flags=st.lists(flag_args(), min_size=1, max_size=3))
@example(flags=[["--base-lr", "nan"]])
@example(flags=[["--sizes", "\udcff"]])
@example(flags=[["--restore-from", "\udcff"]])
@example(flags=[["--base-lr", "inf"]])
@example(flags=[["--target-loss", "1e400"]])
@example(flags=[["--mem-cap-gib", "-0"]])
@example(flags=[["--monitor-hz", "-inf"]])
@example(flags=[["--gpus", ""]])
@example(flags=[["--gpus", "1,,2"]])
@example(flags=[["--sizes", ","]])
@example(flags=[["--strategies", " "]])
@example(flags=[["--seq-len", "\u00b2"]])
@example(flags=[["--steps", "\u0661"]])
@example(flags=[["--degrees", "tp=0"]])
@example(flags=[["--degrees", "x=1"]])
@example(flags=[["--seq-len", "9" * 30]])
@example(flags=[["--gpus", "9" * 30]])
@example(flags=[["--batch", "auto"]])
@example(flags=[["--checkpoint", "async-pinned"]])
@example(flags=[["--checkpoint-keep"]])
@example(flags=[["--restore-from", "no/such/step"]])
@example(flags=[["--device", "cuda"]])
@example(flags=[["--nnodes", "0"]])
@example(flags=[["--model", "no/such/config.json"]])
def test_sweep_flags_return_a_plan_or_refuse(flags: list[list[str]]) -> None:
    """``harness plan --device cpu FLAG VALUE ...``: a plan, a UsageError or argparse's exit 2."""
    plan(["plan", "--device", "cpu", *(word for flag in flags for word in flag)])


# ---------------------------------------------------------------- 2. sweep files

FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def sweep_file_path(root: Path, path: Path) -> None:
    """A sweep file through its reader and, where it reads, through ``harness plan --sweep FILE``."""
    ok, values = refused_or(_read_sweep_file, path, KNOWN)
    if not ok:
        return
    assert isinstance(values, dict)
    # A --model factory names a module to import and a function to call: never one an arbitrary file names.
    if any(FACTORY.fullmatch(m.strip()) for m in str(values.get("model", "")).split(",")):
        return
    plan(["plan", "--device", "cpu", "--sweep", str(path)])


@_settings("sweep_bytes")
@given(data=st.one_of(st.binary(max_size=200), PLAIN_TEXT.map(str.encode),
                      st.text(max_size=200).map(str.encode)))
@example(data=b"\xff")
@example(data=b'sizes = "tiny"\n\xfe\xff')
@example(data=b"\xef\xbb\xbfsizes = \"tiny\"\n")
@example(data=b"sizes = \"\xe9\"\n")
@example(data=b"sizes = \"tiny\"\x00\n")
def test_sweep_file_bytes_read_or_refuse(workdir: Path, data: bytes) -> None:
    """Any bytes as a sweep file: read, or a UsageError naming the file."""
    with scratch(workdir) as root:
        sweep_file_path(root, write(root, "sweep.toml", data))


SWEEP_KEYS = sorted((KNOWN - {"model"}) | {k.replace("_", "-") for k in KNOWN - {"model"}}
                    | {"sweep", "Sizes", "size", "recompute", "device_mem", ""})
"""A sweep file's keys: each flag's, hyphenated too, and near misses (unknown keys, what-if keys)."""


@st.composite
def sweep_documents(draw) -> dict[str, Any]:
    """Mostly keys of good values (hyphenated or not), then a few keys (a known one, or a near miss) of odd ones:
    tables, arrays of tables, lists of lists, NaN, huge numbers, words of another flag."""
    doc: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(sorted(GOOD_SWEEP)), max_size=5, unique=True)):
        doc[key.replace("_", "-") if draw(st.booleans()) else key] = draw(GOOD_SWEEP[key])
    for key in draw(st.lists(st.sampled_from(SWEEP_KEYS), max_size=2, unique=True)):
        doc[key] = draw(sections(NESTED))
    return doc


@_settings("sweep_toml")
@given(doc=sweep_documents())
@example(doc={"base_lr": NAN})
@example(doc={"base_lr": INF})
@example(doc={"target_loss": Raw("1e400")})
@example(doc={"mem_cap_gib": -0.0})
@example(doc={"monitor_hz": True})
@example(doc={"gpus": []})
@example(doc={"gpus": [[1, 2]]})
@example(doc={"gpus": [1, "", 2]})
@example(doc={"sizes": [{"a": 1}]})
@example(doc={"steps": True})
@example(doc={"seed": 1.5})
@example(doc={"force": "no"})
@example(doc={"profile": 1})
@example(doc={"seq_len": Table({"a": 1})})
@example(doc={"strategies": TableArray([{"a": 1}])})
@example(doc={"degrees": "tp=0"})
@example(doc={"batch": Raw("1979-05-27")})
@example(doc={"degrees": 1})
@example(doc={"restore_from": NAN})
@example(doc={"restore_from": "\x00"})
def test_sweep_file_toml_plans_or_refuses(workdir: Path, doc: dict[str, Any]) -> None:
    """A well-formed TOML sweep file of the sweep's keys, odd values: a plan or a UsageError."""
    with scratch(workdir) as root:
        sweep_file_path(root, write(root, "sweep.toml", toml_document(doc).encode()))


# ---------------------------------------------------------------- 3. device files

PRODUCTS = tuple(dict.fromkeys(d.product for d in DEVICES.values()))
GOOD_NUMBERS = st.one_of(st.integers(1, 10_000), st.floats(0.01, 10_000.0))
DEVICE_NUMBERS = st.one_of(GOOD_NUMBERS, ODD_NUMBERS, st.booleans(), st.text(max_size=6),
                           st.sampled_from(RAW_LITERALS).map(Raw), st.lists(GOOD_NUMBERS, max_size=2),
                           st.dictionaries(st.sampled_from(("bf16", "x")), GOOD_NUMBERS, max_size=1))
DTYPES = ("bf16", "fp16", "fp32", "tf32", "fp8", "int8", "", "BF16")
ATTENTION_NAMES = ("fa2_hopper", "fa2_ampere")
SOURCE_NAMES = ("hta", "mamf", "babelstream", "h200_calibration", "nope")


def _rate_values() -> dict[str, st.SearchStrategy]:
    text = st.one_of(st.text(max_size=8), DEVICE_NUMBERS)
    by_key: dict[str, st.SearchStrategy] = {
        "sms": DEVICE_NUMBERS,
        "gemm_tflops": st.one_of(st.dictionaries(st.sampled_from(DTYPES), DEVICE_NUMBERS, max_size=3),
                                 DEVICE_NUMBERS),
        "gemm_source": text,
        "attention": st.one_of(st.sampled_from(ATTENTION_NAMES), text),
        "hbm_measured_tbps": DEVICE_NUMBERS,
        "hbm_source": text,
        "launch_us": DEVICE_NUMBERS,
        "launch_source": st.one_of(st.sampled_from(SOURCE_NAMES), text),
        "kernel_floor_us": DEVICE_NUMBERS,
    }
    assert set(by_key) == set(RATE_KEYS), "a new [op_rates] key: give it values here"
    return by_key


OP_RATES = st.fixed_dictionaries({}, optional={**_rate_values(), "bogus": DEVICE_NUMBERS})


def _device_values() -> dict[str, st.SearchStrategy]:
    by_key: dict[str, st.SearchStrategy] = {
        "base": st.one_of(st.sampled_from(tuple(DEVICES)), st.sampled_from(("H100", "nope", "", "cpu")), SCALARS),
        "name": st.one_of(st.text(max_size=8), DEVICE_NUMBERS),
        "product": st.one_of(st.sampled_from(PRODUCTS), st.text(max_size=8), DEVICE_NUMBERS),
        "hbm_gib": DEVICE_NUMBERS, "hbm_gbps": DEVICE_NUMBERS, "tdp_w": DEVICE_NUMBERS,
        "power_cap_w": DEVICE_NUMBERS, "gpus_per_node": DEVICE_NUMBERS, "intra_gbps": DEVICE_NUMBERS,
        "inter_gbps": DEVICE_NUMBERS,
        "peak_tflops": st.one_of(st.dictionaries(st.sampled_from(DTYPES), DEVICE_NUMBERS, max_size=3).map(Table),
                                 DEVICE_NUMBERS),
        "op_rates": st.one_of(OP_RATES.map(Table), DEVICE_NUMBERS),
    }
    assert set(by_key) == set(FILE_KEYS), "a new device file key: give it values here"
    return by_key


ODD_DEVICE = {**_device_values(), "bogus": DEVICE_NUMBERS}
ODD_RATES = {**_rate_values(), "bogus": DEVICE_NUMBERS}
GOOD_RATES = {"sms": st.integers(1, 200), "gemm_tflops": st.dictionaries(st.sampled_from(("bf16", "fp8")),
                                                                         GOOD_NUMBERS, max_size=2),
              "gemm_source": st.text(max_size=8), "attention": st.sampled_from(ATTENTION_NAMES),
              "hbm_measured_tbps": st.floats(0.1, 8.0), "hbm_source": st.text(max_size=8),
              "launch_us": st.floats(0.0, 50.0), "launch_source": st.sampled_from(SOURCE_NAMES[:-1]),
              "kernel_floor_us": st.floats(0.0, 10.0)}
GOOD_DEVICE = {"name": st.text(max_size=8), "product": st.sampled_from(PRODUCTS), "hbm_gib": GOOD_NUMBERS,
               "hbm_gbps": GOOD_NUMBERS, "tdp_w": st.floats(300.0, 1000.0), "power_cap_w": st.floats(100.0, 300.0),
               "gpus_per_node": st.integers(1, 16), "intra_gbps": GOOD_NUMBERS, "inter_gbps": GOOD_NUMBERS,
               "peak_tflops": st.dictionaries(st.sampled_from(("bf16", "fp16", "fp8")), GOOD_NUMBERS, min_size=1,
                                              max_size=2).map(Table)}


@st.composite
def device_documents(draw) -> dict[str, Any]:
    """A device file: a preset's name as base (mostly), keys of good values over it, then one or two keys of odd
    values, in the file or in its [op_rates]; or, without a base, every key a file then needs, some odd."""
    doc: dict[str, Any] = {}
    if draw(st.integers(0, 3)):
        doc["base"] = draw(st.sampled_from(tuple(DEVICES)))
        keys = draw(st.lists(st.sampled_from(sorted(GOOD_DEVICE)), max_size=4, unique=True))
    else:
        keys = [k for k in GOOD_DEVICE if k != "power_cap_w"]
    doc.update({k: draw(GOOD_DEVICE[k]) for k in keys})
    rates = {k: draw(GOOD_RATES[k]) for k in draw(st.lists(st.sampled_from(sorted(GOOD_RATES)), max_size=3,
                                                           unique=True))}
    if "base" not in doc:
        rates.update({k: draw(GOOD_RATES[k]) for k in ("sms", "attention", "launch_us")})
    for key in draw(st.lists(st.sampled_from(sorted(ODD_RATES)), max_size=2, unique=True)):
        rates[key] = draw(ODD_RATES[key])
    if rates:
        doc["op_rates"] = Table(rates)
    for key in draw(st.lists(st.sampled_from(sorted(ODD_DEVICE)), max_size=2, unique=True)):
        doc[key] = draw(ODD_DEVICE[key])
    return doc


MEM_OR_CAP = st.one_of(st.none(), GOOD_NUMBERS, st.sampled_from((NAN, INF, -INF, 0.0, -0.0, -1.0, 1e308, 5e-324)),
                       st.floats())


def peak_tflops(dev: Device) -> dict[str, float]:
    return dev.peak_tflops


def op_rates(dev: Device) -> OpRates:
    return dev.op_rates


def check_device(dev: Device) -> None:
    """What a device file gave, as the pricing takes it: every size and rate a finite number > 0."""
    assert isinstance(dev, Device)
    for name in ("hbm_gib", "hbm_gbps"):
        assert finite(getattr(dev, name)) and getattr(dev, name) > 0, f"{name} = {getattr(dev, name)!r} accepted"
    assert finite(dev.tdp_w) and dev.tdp_w >= 0, f"tdp_w = {dev.tdp_w!r} accepted"
    cap = dev.power_cap_w
    assert cap is None or (finite(cap) and 0 < cap <= dev.tdp_w), f"power_cap_w = {cap!r} accepted"
    assert isinstance(dev.gpus_per_node, int) and dev.gpus_per_node >= 1
    for link in (dev.intra, dev.inter):
        assert finite(link.gbps) and link.gbps > 0, f"{link.name}: {link.gbps!r} GB/s accepted"
    ok, peaks = refused_or(peak_tflops, dev)
    assert ok, "device_from_file returned a device whose peak_tflops is a UsageError"
    for dtype, peak in peaks.items():
        assert finite(peak) and peak > 0, f"peak_tflops.{dtype} = {peak!r} accepted"
    ok, rates = refused_or(op_rates, dev)
    assert ok, "device_from_file returned a device whose op_rates is a UsageError"
    for dtype, tflops in rates.gemm_tflops:
        assert finite(tflops) and tflops > 0, f"op_rates gemm_tflops.{dtype} = {tflops!r} accepted"
    assert isinstance(rates.sms, int) and rates.sms >= 1, f"op_rates sms = {rates.sms!r} accepted"
    assert finite(rates.bandwidth_efficiency) and rates.bandwidth_efficiency > 0, \
        f"op_rates bandwidth efficiency {rates.bandwidth_efficiency!r} accepted"
    assert finite(rates.launch_s) and rates.launch_s >= 0, f"op_rates launch {rates.launch_s!r} s accepted"
    assert finite(rates.kernel_floor_s) and rates.kernel_floor_s >= 0, \
        f"op_rates kernel floor {rates.kernel_floor_s!r} s accepted"


def device_file_path(path: Path, mem_gib: float | None, power_cap_w: float | None) -> None:
    """A device file through its reader, ``device_arg`` with overrides, and, where it reads, a what-if on it
    (``harness plan --device FILE``: three strategies over two nodes of a small size, priced op by op)."""
    ok, dev = refused_or(device_from_file, path)
    if not ok:
        return
    check_device(dev)
    ok, capped = refused_or(device_arg, str(path), mem_gib, power_cap_w)
    if ok:
        check_device(capped)
    run_main(["plan", "--device", str(path), "--gpus", str(2 * dev.gpus_per_node if dev.gpus_per_node < 64 else 8),
              "--sizes", "small", "--strategies", "fsdp,tp,pp", "--error-from", str(path.parent)], codes=(0, 2))


@_settings("device_file")
@given(doc=st.one_of(device_documents(), device_documents(), device_documents(), st.binary(max_size=120)),
       mem_gib=MEM_OR_CAP, power_cap_w=MEM_OR_CAP)
@example(doc=b"\xff", mem_gib=None, power_cap_w=None)
@example(doc=b'base = "h100"\nname = "\xe9"\n', mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "hbm_gib": INF}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "hbm_gbps": Raw("1e400")}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "peak_tflops": Table({"bf16": INF})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "gpus_per_node": 10**30}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100"}, mem_gib=INF, power_cap_w=None)
@example(doc={"base": "h100"}, mem_gib=None, power_cap_w=NAN)
@example(doc={"base": "h100", "op_rates": Table({"sms": INF})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"sms": [1]})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"sms": 0})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"attention": [1]})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"launch_us": "x"})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"launch_us": -1})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"launch_source": 1})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"hbm_measured_tbps": 2.0})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"gemm_tflops": 700})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"hbm_measured_tbps": 5e-324})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"hbm_measured_tbps": 1e308})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"gemm_tflops": {"bf16": "x"}})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "op_rates": Table({"kernel_floor_us": NAN})}, mem_gib=None, power_cap_w=None)
@example(doc={"base": 1}, mem_gib=None, power_cap_w=None)
@example(doc={"base": "h100", "product": "x", "peak_tflops": Table({"bf16": 1})}, mem_gib=None, power_cap_w=None)
def test_device_file_reads_or_refuses(workdir: Path, doc: dict[str, Any] | bytes, mem_gib: float | None,
                                      power_cap_w: float | None) -> None:
    """A device file (bytes, or TOML of its keys with odd values), then ``device_arg`` with odd overrides: a device
    whose every figure is a finite positive number, or a UsageError."""
    data = doc if isinstance(doc, bytes) else toml_document(doc).encode()
    with scratch(workdir) as root:
        device_file_path(write(root, "dev.toml", data), mem_gib, power_cap_w)


# ---------------------------------------------------------------- 4. records


def valid_record(cell_id: str = "a", status: str = "ok", times: tuple[float, ...] = (0.5, 0.52, 0.49, 0.51, 0.5, 0.53),
                 kind: str = "cell") -> dict[str, Any]:
    """A record as ``harness bench`` writes one (trimmed: the fields the readers below look at)."""
    if kind == "calibration":
        return make_record(run_id="r", cell_id="calibration", status="ok", kind="calibration",
                           config={"workload": "matmul", "device_kind": "cpu", "tokens_per_step": 1}, env={},
                           degrees=None, workload={"name": "matmul"}, metrics={"tokens_per_step": 1},
                           samples={"step_time_s": list(times)})
    median = sorted(times)[len(times) // 2]
    config = {"size": "tiny", "strategy": "single", "precision": "fp32", "world_size": 1, "global_batch": 8 * len(cell_id),
              "seq_len": 64, "steps": len(times), "warmup": 1, "device_kind": "cpu", "nnodes": 1, "grad_accum": 1,
              "microbatches": 1, "pp_schedule": "1f1b", "scaling": "strong", "lr_rule": "none", "arch": "gpt2"}
    metrics = {"tokens_per_step": 512, "tokens_per_s": 512 / median, "tokens_per_s_per_device": 512 / median,
               "step_time_s": {"median": median, "mean": sum(times) / len(times), "n": len(times), "cv": 0.02},
               "peak_mem_gib": 0.1, "mfu_pct": None, "final_loss": 5.0, "loss": [6.0, 5.0], "unstable": False}
    return make_record(run_id="r", cell_id=cell_id, status=status, config=config,
                       env={"git_sha": "0" * 40, "device_name": "cpu", "torch": "2"}, degrees=None,
                       workload={"name": "tiny", "params": 1000, "seq_len": 64}, metrics=metrics,
                       samples={"step_time_s": list(times)})


VALID_RECORDS = st.builds(
    valid_record, cell_id=st.sampled_from(("a", "bb")), status=st.sampled_from(("ok", "ok", "oom", "crashed")),
    times=st.lists(st.floats(1e-3, 1.0), min_size=1, max_size=8).map(tuple),
    kind=st.sampled_from(("cell", "cell", "cell", "calibration")))
WRONG = st.one_of(
    st.sampled_from((None, [], [1], ["a"], "", "x", "1", 0, 1, 2, -1, 1.5, NAN, INF, -INF, True, {}, {"a": 1},
                     {"median": "x"}, [[1]], "calibration", "unknown")),
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4)),
                 lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
                 max_leaves=4))
DELETE = object()
FIELD_PATHS = (*((k,) for k in valid_record()),
               *(("metrics", k) for k in valid_record()["metrics"]), ("metrics", "parity"), ("metrics", "rounds"),
               ("metrics", "unstable_reason"), ("metrics", "comm"), ("metrics", "composition"),
               *(("samples", k) for k in ("step_time_s", "step_time_s_per_rank", "machine_probe_s")),
               *(("config", k) for k in valid_record()["config"]), ("config", "degrees"), ("env", "git_sha"),
               ("fingerprint_fields", "size"), ("workload", "params"))
"""Where a mistyped value goes: each field of a record, and each field inside the ones the readers open."""


def mutated(record: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """``record`` with the field at ``path`` set to ``value`` (:data:`DELETE`: removed); a field inside a field that
    is not an object replaces that field with one."""
    out = json.loads(json.dumps(record))
    at = out
    for key in path[:-1]:
        if not isinstance(at.get(key), dict):
            at[key] = {}
        at = at[key]
    if value is DELETE:
        at.pop(path[-1], None)
    else:
        at[path[-1]] = value
    return out


MUTATED_RECORDS = st.builds(mutated, VALID_RECORDS, st.sampled_from(FIELD_PATHS),
                            st.one_of(WRONG, st.just(DELETE)))


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


RECORD_LINES = st.one_of(VALID_RECORDS, MUTATED_RECORDS, MUTATED_RECORDS).map(dumps)
ODD_LINES = st.one_of(
    WRONG.map(dumps),  # JSON that is not an object (and some that is)
    st.sampled_from((b"{", b'{"kind": "cell",', b'{"a": 1}}', b"nul", b"[1,", b'"', b"NaN", b"{'a': 1}")),
    st.text(max_size=30).map(str.encode), st.binary(max_size=30), st.sampled_from((b"", b"  ", b"\t", b"\r")))
LINES = st.one_of(RECORD_LINES, RECORD_LINES, RECORD_LINES, ODD_LINES)
"""A records file's lines: records (whole, or with a field of the wrong type), then anything else."""


def records_file_of(lines: list[bytes], torn: bool) -> bytes:
    """The lines as a records.jsonl; ``torn``: no newline after the last (an interrupted append)."""
    return b"\n".join(lines) + (b"" if torn else b"\n")


def _known(lines: list[bytes | dict[str, Any]], torn: bool = False) -> dict[str, Any]:
    return {"lines": [x if isinstance(x, bytes) else dumps(x) for x in lines], "torn": torn}


@pytest.fixture(scope="module")
def base_run(workdir: Path) -> Path:
    """A run of whole records: the other side of ``diff``, ``history`` and ``compare``."""
    run = workdir / "base"
    run.mkdir()
    records = [valid_record(kind="calibration"), valid_record("a"), valid_record("bb", times=(0.3, 0.31, 0.29, 0.3, 0.32, 0.3))]
    write(run, "records.jsonl", records_file_of([dumps(r) for r in records], torn=False))
    return run


OPTS = CompareOptions(n_bootstrap=200)
OPTS_CALIBRATION = CompareOptions(n_bootstrap=200, normalize="calibration")


def records_path(base: Path, run: Path) -> None:
    """A records file through its reader, what renders its records, and the commands that read a run."""
    path = run / "records.jsonl"
    ok, read = refused_or(read_records, path)
    loaded, records = refused_or(load_records, path, io.StringIO())
    assert ok == loaded, "read_records and load_records disagree on whether the file reads"
    if loaded:
        assert records == read[0]
        assert all(isinstance(r, dict) for r in records)
        refused_or(RunFrames.of, records)
        base_records = load_records(base / "records.jsonl")
        for opts in (OPTS, OPTS_CALIBRATION):
            refused_or(compare, base_records, records, opts)
            refused_or(compare, records, base_records, opts)
    run_main(["report", str(run)], codes=(0, 2))
    run_main(["diff", str(base), str(run), "--out", str(run / "diff.md"), "--bootstrap", "200"], codes=(0, 2))
    run_main(["history", str(base), str(run), "--out", str(run / "history")], codes=(0, 2))
    run_main(["compare", str(base), str(run), "--bootstrap", "200"], codes=(0, 1, 2, 3))
    run_main(["compare", str(run), str(base), "--bootstrap", "200", "--normalize", "calibration"],
             codes=(0, 1, 2, 3))


@_settings("records")
@given(lines=st.lists(LINES, min_size=0, max_size=5), torn=st.booleans())
@example(**_known([b"\xff\xfe"]))
@example(**_known([valid_record(), b"\xff{"]))
@example(**_known([valid_record(), b"{", valid_record("bb")]))
@example(**_known([valid_record(), b'{"cell_id": "b"'], torn=True))
@example(**_known([b"", b"  ", valid_record()]))
@example(**_known([[1, 2]]))
@example(**_known([1]))
@example(**_known(["x"]))
@example(**_known([None]))
@example(**_known([mutated(valid_record(), ("metrics",), [])]))
@example(**_known([mutated(valid_record(), ("metrics",), "x")]))
@example(**_known([mutated(valid_record(), ("metrics",), 1)]))
@example(**_known([mutated(valid_record(), ("metrics",), None)]))
@example(**_known([mutated(valid_record(), ("samples",), "x")]))
@example(**_known([mutated(valid_record(), ("samples", "step_time_s"), "x")]))
@example(**_known([mutated(valid_record(), ("status",), "unknown")]))
@example(**_known([mutated(valid_record(), ("schema_version",), 0)]))
@example(**_known([mutated(valid_record(), ("schema_version",), 2)]))
@example(**_known([mutated(valid_record(), ("schema_version",), "1")]))
@example(**_known([mutated(valid_record(), ("schema_version",), DELETE)]))
@example(**_known([mutated(valid_record(), ("kind",), "unknown")]))
@example(**_known([mutated(valid_record(), ("cell_id",), 1)]))
@example(**_known([mutated(valid_record(), ("config",), [])]))
@example(**_known([mutated(valid_record(), ("metrics", "tokens_per_s_per_device"), "x")]))
@example(**_known([mutated(valid_record(kind="calibration"), ("samples", "step_time_s"), [])]))
@example(**_known([mutated(valid_record(), ("config", "strategy"), [])]))
@example(**_known([mutated(valid_record(), ("config", "degrees"), [1])]))
@example(**_known([mutated(valid_record(), ("config", "precision"), [])]))
@example(**_known([mutated(valid_record(), ("config", "size"), [])]))
@example(**_known([mutated(valid_record(), ("config", "scaling"), [])]))
@example(**_known([mutated(valid_record(), ("metrics", "tokens_per_s"), 0)]))
@example(**_known([mutated(valid_record(), ("env", "git_sha"), [1])]))
@example(**_known([mutated(valid_record(), ("env", "git_sha"), -1)]))
def test_records_read_render_or_refuse(workdir: Path, base_run: Path, lines: list[bytes], torn: bool) -> None:
    """A records.jsonl of any lines: its records read (then report, compare, diff and history render them), or a
    UsageError naming the file and the line; ``harness report|diff|history|compare`` exit with a code."""
    with scratch(workdir) as run:
        write(run, "records.jsonl", records_file_of(lines, torn))
        records_path(base_run, run)

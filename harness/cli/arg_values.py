"""The sweep flags' values read at the door: lists, counts, degrees, fractions, models and checkpoints, each a
one-line UsageError naming the flag, the value and the fix (exit 2) when it cannot be read."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from harness.errors import UsageError
from harness.run.resume import source_error
from harness.spec import CHECKPOINT_MODES
from workloads.config_file import ConfigError
from workloads.hf_models import config_model
from workloads.own_model import OwnModel, is_factory, own_model
from workloads.sizes import ModelSize, get_size


def path_arg(text: str) -> Path:
    """A path flag's value: an empty one (``--out ""``) would mean the current folder, and is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is an empty path (it would be the current folder); give a path, "
                                         f"e.g. results/run1")
    return Path(text)


def csv_list(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def listed(name: str, s, example: str) -> tuple[str, ...]:
    """A comma list (a sweep file's list arrives joined) that names at least one value: an empty one sweeps nothing."""
    out = csv_list(str(s))
    if not out:
        raise UsageError(f"{name} {s!r} is empty: it would sweep nothing; give a value, e.g. {example}, or drop it")
    return out


def ints(name: str, s: str, minimum: int = 1, example: str = "2 or 1,2,4") -> tuple[int, ...]:
    out = []
    for x in csv_list(str(s)):
        if not _integer(x) or int(x) < minimum:
            raise UsageError(f"{name} {s!r}: each value must be an integer >= {minimum}, e.g. {example}")
        out.append(int(x))
    if not out:
        raise UsageError(f"{name} is empty; give an integer >= {minimum}")
    return tuple(out)


def _integer(s: str) -> bool:
    """Decimal ASCII digits with an optional minus (``str.isdigit`` also takes superscripts ``int`` refuses)."""
    return re.fullmatch(r"-?[0-9]+", s) is not None


def int_arg(name: str, v, minimum: int) -> int:
    s = str(v).strip()
    if isinstance(v, bool) or not _integer(s) or int(s) < minimum:
        raise UsageError(f"{name} {v!r}: must be an integer >= {minimum}")
    return int(s)


def choices(name: str, s, valid: tuple[str, ...]) -> tuple[str, ...]:
    """A comma list whose every value is one of ``valid`` (the error names the value and the choices)."""
    out = csv_list(str(s))
    for x in out:
        if x not in valid:
            raise UsageError(f"{name} {x!r}: choose from {', '.join(valid)} (a list sweeps them, e.g. {','.join(valid)})")
    if not out:
        raise UsageError(f"{name} is empty; choose from {', '.join(valid)}")
    return out


def restore_from_arg(v) -> str | None:
    """``--restore-from STEP_DIR``: a complete save with the harness's progress files, as an absolute path."""
    if "restore_from" not in v:
        return None
    path = Path(v["restore_from"]).resolve()
    if error := source_error(path):
        raise UsageError(error)
    return str(path)


def checkpoints_arg(v, device: str = "cpu") -> tuple[str, ...]:
    """``--checkpoint off,sync,async,async-pinned`` (default off): each mode a cell of its own; ``async`` only where
    ``torch.distributed.checkpoint`` has ``async_save``, ``async-pinned`` where it has a pinned-memory stager and
    on GPUs (it pins host memory for the device-to-host copy)."""
    if v.get("checkpoint", "off") == "off":
        return ("off",)
    modes = choices(v.label("checkpoint"), v["checkpoint"], CHECKPOINT_MODES)
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 (heavy: DCP, only when checkpoints are asked for)

    if any(m.startswith("async") for m in modes) and not hasattr(dcp, "async_save"):
        raise UsageError("--checkpoint async: this torch's torch.distributed.checkpoint has no async_save; "
                         "use --checkpoint sync, or a torch >= 2.4")
    if "async-pinned" in modes and device != "cuda":
        raise UsageError("--checkpoint async-pinned stages a GPU's state in pinned host memory: n/a on CPU ranks "
                         "(their state is host memory already); use --checkpoint async")
    if "async-pinned" in modes and not hasattr(getattr(dcp, "staging", None), "DefaultStager"):
        raise UsageError("--checkpoint async-pinned: this torch's torch.distributed.checkpoint has no DefaultStager "
                         "(pinned-memory staging); use --checkpoint async, or a torch >= 2.9")
    return modes


def workload_keys(archs: tuple[str, ...], sizes: tuple[str, ...]) -> list[str]:
    """Each family's sizes as keys unique over families (``tiny``, ``llama3-8b``); an unknown size is a
    UsageError listing the family's names."""
    try:
        return [get_size(name, arch).key for arch in archs for name in sizes]
    except ValueError as e:
        raise UsageError(f"--sizes: {e}") from None


def models_arg(v, device_kind: str) -> tuple[ModelSize | OwnModel, ...]:
    """``--model PATH[,PATH]``: each a ``config.json`` (or a folder holding one) resolved into a workload, here and
    once; on CPU ranks shrunk by :mod:`workloads.shrink`'s rules unless ``--full-size``; or ``package.module:factory``,
    a module of your own (:mod:`workloads.own_model`), as its factory builds it. Empty when not given.
    ``--model`` beside ``--sizes`` or ``--arch`` is refused: it replaces them."""
    if "model" not in v:
        if v.get("full_size"):
            raise UsageError("--full-size runs a --model as given (not shrunk for CPU ranks); it needs --model")
        return ()
    for other in ("sizes", "arch"):
        if other in v:
            raise UsageError(f"--model with {v.label(other)}: a --model is the workload, in place of the built-in "
                             f"sizes; give one or the other (a comma list sweeps several models)")
    values = csv_list(str(v["model"]))
    if not values:
        raise UsageError(f"{v.label('model')} is empty; give a config.json, or a folder holding one")
    shrunk = device_kind == "cpu" and not v.get("full_size")
    out: list[ModelSize | OwnModel] = []
    for value in values:
        try:
            out.append(own_model(value) if is_factory(value) else config_model(value, shrunk=shrunk))
        except ConfigError as e:
            raise UsageError(str(e)) from None
    return tuple(dict.fromkeys(out))


def model_notes(models: tuple[ModelSize | OwnModel, ...]) -> list[str]:
    """One line per note of each model's mapping (what it builds differently or leaves out), to print once; for a
    module of your own, what is counted of it and what is not priced."""
    out = []
    for m in models:
        if isinstance(m, OwnModel):
            out.append(f"note: {m.name} ({m.factory}): {m.params:,} parameters, {m.flops_per_token():,} FLOPs per token "
                       f"(counted by FlopCounterMode on the meta device), {m.n_blocks} x {m.block}; its memory, "
                       f"communication and step time are not priced (the analytic model prices the harness's own "
                       f"layers)")
        elif m.origin is not None:
            out += [f"note: {m.origin.name}: {n}" for n in m.origin.notes]
    return out


def seq_lens_arg(name: str, v) -> tuple[int, ...]:
    """``--seq-len 256,512``: each a sequence length >= 1 (a sweep file may give an int, a list or a comma string)."""
    return ints(name, v, 1, example="512 or 256,512,1024")


def degrees_arg(s: str | None) -> dict | None:
    if not s:
        return None
    out = {}
    for part in csv_list(s):
        k, _, v = part.partition("=")
        if not k.strip() or not _integer(v.strip()) or int(v) < 1:
            raise UsageError(f"--degrees {s!r}: expected name=int pairs with each degree >= 1, like pp=2,tp=2")
        out[k.strip()] = int(v)
    return out


def _number(name: str, v, expected: str) -> float:
    """A finite number (a flag's text or a sweep file's value); NaN, the infinities and a TOML boolean are refused."""
    try:
        x = float(v) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        raise UsageError(f"{name} {v!r}: expected {expected}") from None
    if not math.isfinite(x):
        raise UsageError(f"{name} {v!r}: not a finite number; expected {expected}")
    return x


def rate_value(name: str, v) -> float:
    x = _number(name, v, "a rate in Hz >= 0, e.g. 10 (0 turns the monitor off)")
    if not 0.0 <= x <= 1000.0:
        raise UsageError(f"{name} {v!r}: must be a rate in Hz in [0, 1000], e.g. 10 (0 turns the monitor off)")
    return x


def positive_float(name: str, v) -> float:
    x = _number(name, v, "a number > 0")
    if x <= 0:
        raise UsageError(f"{name} {v!r}: must be > 0")
    return x


def fraction(name: str, v, of: str = "the datasheet peak", e_g: str = "0.4") -> float:
    x = _number(name, v, f"a fraction in (0, 1], e.g. {e_g}")
    if not 0 < x <= 1:
        raise UsageError(f"{name} {v!r}: must be a fraction of {of} in (0, 1], e.g. {e_g}")
    return x

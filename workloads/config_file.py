"""Reading a Hugging Face style ``config.json`` strictly: the file, its type, and each field with its type checked.

A config is read once, where the user names it (``--model PATH``): a file, or a folder holding ``config.json`` (a
downloaded checkpoint folder; weights are never read). Nothing is fetched: a hub name that is not a local path is
refused with the command that downloads its ``config.json``. Every error is one :class:`ConfigError` line naming the
file, the field and the fix; :mod:`workloads.hf_models` maps the fields onto the harness's layers.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
DIGEST_CHARS = 12
_REQUIRED = object()
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ConfigError(ValueError):
    """A config that cannot be read or mapped: one line naming the file, the field and the fix."""


def config_path(value: str) -> Path:
    """The ``config.json`` a ``--model`` value names: the file, or the one in the folder."""
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / CONFIG_NAME
        if not path.is_file():
            raise ConfigError(f"--model {value}: the folder has no {CONFIG_NAME}; give the config file, or the "
                              f"checkpoint folder that holds it")
        return path
    if path.is_file():
        return path
    if HUB_NAME.match(value) and not value.endswith(".json"):
        raise ConfigError(f"--model {value}: no such file or folder here, and nothing is fetched: download its config "
                          f"first (hf download {value} {CONFIG_NAME} --local-dir {value.split('/')[-1]}) and give "
                          f"--model {value.split('/')[-1]}")
    raise ConfigError(f"--model {value}: no such file or folder; give a config.json, or a folder holding one")


def read_json(path: Path) -> dict[str, Any]:
    """The file's JSON object; ConfigError for bytes that are not UTF-8, text that is not JSON, or not an object."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"--model {path}: cannot read it ({e.strerror or e}); check the path and its permissions") \
            from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--model {path}: not UTF-8 text (byte {e.start}); a config.json is JSON text") from None
    try:
        content = json.loads(text, parse_constant=_no_constant)
    except ConfigError as e:  # NaN, Infinity: JSON has no such numbers, Python's parser takes them unless told
        raise ConfigError(f"--model {path}: not valid JSON ({e}); fix the file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--model {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix the "
                          f"file") from None
    if not isinstance(content, dict):
        raise ConfigError(f"--model {path}: a config.json holds one JSON object, this holds a "
                          f"{type(content).__name__}; give the model's config.json")
    return content


def _no_constant(name: str) -> Any:
    raise ConfigError(f"{name} is not a JSON number; write a finite number")


def digest(content: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a config (sorted keys), :data:`DIGEST_CHARS` hex characters."""
    return hashlib.sha256(canonical(content).encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def canonical(content: dict[str, Any]) -> str:
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def model_name(path: Path) -> str:
    """The file's stem, or the folder's name for a ``config.json``; characters a cell id cannot hold become ``_``."""
    stem = path.parent.name if path.name == CONFIG_NAME and path.parent.name else path.stem
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem) or "model"


def _kind(value: Any) -> str:
    return "null" if value is None else {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                                         list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


class Fields:
    """A config's fields, read with their types checked; remembers which were read, so the rest can be named."""

    def __init__(self, content: dict[str, Any], where: str, model_type: str) -> None:
        self.content, self.where, self.model_type = content, where, model_type
        self.read: set[str] = set()

    def has(self, key: str) -> bool:
        """Whether the field is set (not null); asking reads it."""
        self.read.add(key)
        return self.content.get(key) is not None

    def _get(self, key: str, default: Any) -> Any:
        self.read.add(key)
        if self.content.get(key) is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.where}: missing {key!r}, which a {self.model_type} config needs; add it "
                                  f"(the model's published config.json has it)")
            return default
        return self.content[key]

    def _wrong(self, key: str, value: Any, expected: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key} = {json.dumps(value)} is {_kind(value)}, expected {expected}; fix "
                           f"the file")

    def integer(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self._wrong(key, value, f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: Any = _REQUIRED, positive: bool = True) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or (
                positive and value <= 0):
            raise self._wrong(key, value, "a finite number" + (" > 0" if positive else ""))
        return float(value)

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is not default and not isinstance(value, bool):
            raise self._wrong(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is not default and not isinstance(value, str):
            raise self._wrong(key, value, "a string")
        return value

    def obj(self, key: str) -> dict[str, Any]:
        value = self._get(key, {})
        if not isinstance(value, dict):
            raise self._wrong(key, value, "an object")
        return value

    def items(self, key: str) -> list:
        value = self._get(key, [])
        if not isinstance(value, list):
            raise self._wrong(key, value, "a list")
        return value

    def sub(self, key: str) -> Fields:
        """A nested object's fields (MPT's ``attn_config``), named ``key.field`` in errors."""
        return Fields(self.obj(key), f"{self.where}: {key}", self.model_type)

    def unread(self) -> list[str]:
        return sorted(k for k in self.content if k not in self.read)

"""A cell's workload from what its config carries: the one place a workload is rebuilt from a record.

A user's own ``nn.Module`` (:mod:`workloads.own_model`) is rebuilt by importing its factory again.

A built-in size is a name in :mod:`workloads.sizes`' tables (``size`` and ``arch``); a config model carries its
source (``model``: the config's content, its digest and the shrink it ran under), so a record rebuilds it without the
original file (``report``, ``diff``, ``--resume``, ``plan --fit-from``).
"""

from __future__ import annotations

from typing import Any

from workloads.architecture import CONFIG_ARCH, MODULE_ARCH, ModelSize
from workloads.hf_models import model_from_origin
from workloads.own_model import OwnModel, module_from_origin
from workloads.sizes import get_size

OWN_ARCHS = (CONFIG_ARCH, MODULE_ARCH)
"""The ``arch`` of a user's own model (a ``config.json``, an ``nn.Module`` factory)."""


def workload_of(size: str, arch: str | None, model: dict[str, Any] | None) -> ModelSize | OwnModel:
    """The workload a cell config names: its ``model`` when it carries one, else the named size (``arch`` None: a
    size's key, ``llama3-8b``, or a gpt2 name). ValueError (one line) when neither resolves."""
    if model is not None:
        return module_from_origin(model) if model.get("kind") == "module" else model_from_origin(model)
    if arch in OWN_ARCHS:
        raise ValueError(f"size {size!r} of arch {arch}: the config carries no model to rebuild it from")
    return get_size(size, arch)


def config_workload(config: dict[str, Any]) -> ModelSize | OwnModel:
    """:func:`workload_of` a raw cell config (a record's ``config``; gpt2 when it predates the arch axis)."""
    return workload_of(config["size"], config.get("arch"), config.get("model"))

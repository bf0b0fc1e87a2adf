"""A user's own ``nn.Module`` as a workload: ``--model package.module:factory``.

The factory is a function of no arguments that returns what the harness needs to train the model, as a dict or
any object with these attributes:

* ``model``: the ``nn.Module``; ``model(tokens)`` maps ``(B, T)`` token ids to ``(B, T, vocab)`` logits;
* ``block``: the class of its repeated block (FSDP shards each instance, activation checkpointing and
  ``torch.compile`` wrap each);
* ``vocab_size`` and ``seq_len``: the token range the data draws from, and the sequence it trains at;
* ``tp_plan`` (optional): ``{module name pattern: ParallelStyle}`` for
  :func:`torch.distributed.tensor.parallel.parallelize_module`; without one, tensor parallel is refused.

What the harness can count it counts on the meta device (no memory): every parameter, and the FLOPs per token of
one forward and backward by ``FlopCounterMode``. What it cannot (memory, communication and step time by the
analytic model, which prices the harness's own layers) a plan says is not priced. docs/models.md has an example.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from workloads.architecture import MODULE_ARCH
from workloads.config_file import ConfigError
from workloads.meta import on_meta
from workloads.model_parts import ModelOrigin

FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
REQUIRED = ("model", "block", "vocab_size", "seq_len")


def is_factory(value: str) -> bool:
    """Whether a ``--model`` value names a factory (``package.module:function``) rather than a file."""
    return bool(FACTORY.match(value)) and not os.path.exists(value)


def _import(spec: str) -> Any:
    module_name, _, func = spec.partition(":")
    if os.getcwd() not in sys.path:  # as `python -m` would: the user's modules beside where they run
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--model {spec}: cannot import {module_name!r} ({e}); run from the folder that holds it, "
                          f"or put it on PYTHONPATH") from None
    factory = getattr(module, func, None)
    if not callable(factory):
        raise ConfigError(f"--model {spec}: {module_name} has no function {func!r}; name a function that returns "
                          f"the model, its block class, vocab_size and seq_len (docs/models.md)")
    return factory


def _field(result: Any, name: str) -> Any:
    return result.get(name) if isinstance(result, dict) else getattr(result, name, None)


def build(spec: str) -> dict[str, Any]:
    """Call the factory and check what it returned: ConfigError (one line) for a factory that raises or returns
    something the harness cannot train."""
    factory = _import(spec)
    try:
        result = factory()
    except Exception as e:  # the user's code: any failure is a refusal with its reason, never a traceback
        raise ConfigError(f"--model {spec}: the factory raised {type(e).__name__}: {e}; fix the factory") from None
    missing = [n for n in REQUIRED if _field(result, n) is None]
    if missing:
        raise ConfigError(f"--model {spec}: the factory returned no {', '.join(missing)}; return a dict (or an object) "
                          f"with model, block (the repeated block's class), vocab_size and seq_len")
    model, block = _field(result, "model"), _field(result, "block")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec}: model is a {type(model).__name__}, not an nn.Module")
    if not (inspect.isclass(block) and issubclass(block, nn.Module)):
        raise ConfigError(f"--model {spec}: block is {block!r}, not an nn.Module class; return the class of the "
                          f"model's repeated block")
    if not any(isinstance(m, block) for m in model.modules()):
        raise ConfigError(f"--model {spec}: the model holds no {block.__name__}; block must be the class of its "
                          f"repeated blocks")
    for name in ("vocab_size", "seq_len"):
        value = _field(result, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"--model {spec}: {name} = {value!r}, expected an integer >= 1")
    plan = _field(result, "tp_plan")
    if plan is not None and not isinstance(plan, dict):
        raise ConfigError(f"--model {spec}: tp_plan is a {type(plan).__name__}, expected a dict of module name -> "
                          f"ParallelStyle")
    return {"model": model, "block": block, "vocab_size": _field(result, "vocab_size"),
            "seq_len": _field(result, "seq_len"), "tp_plan": plan}


class OwnModule(nn.Module):
    """The factory's model as the harness trains it: ``inner`` is the user's module (its parameters named
    ``inner.<their name>``); the blocks are its instances of the block class, found, not re-registered."""

    def __init__(self, built: dict[str, Any]) -> None:
        super().__init__()
        self.inner = built["model"]
        self.block_class = built["block"]
        self.tp_plan = built["tp_plan"]
        self.vocab_size = built["vocab_size"]

    def block_items(self) -> list[tuple[str, nn.Module]]:
        """(name, block) of each block instance, in order: what FSDP, checkpointing and compile wrap one by one."""
        return [(name, m) for name, m in self.inner.named_modules() if isinstance(m, self.block_class)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@dataclass(frozen=True)
class OwnModel:
    """A factory's model, counted: what the planner, the records and the report read of a workload."""

    name: str
    """``<function>-<digest>``: the cell id's part."""
    factory: str
    params: int
    flops_counted: int
    """FLOPs of one forward and backward of one sequence at ``seq_len`` (``FlopCounterMode``, meta device)."""
    vocab_size: int
    seq_len: int
    block: str
    """The block class's qualified name."""
    n_blocks: int
    has_tp_plan: bool
    origin: ModelOrigin = field(compare=False)
    device_kind: str = "gpu"
    arch: str = MODULE_ARCH
    moe = None
    mla = None

    @property
    def key(self) -> str:
        return self.name

    @property
    def n_layers(self) -> int:
        """Its blocks, as the inventory numbers them (FSDP's groups)."""
        return self.n_blocks

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Counted FLOPs per token at ``seq_len`` (the attention's share is counted at the factory's length)."""
        return self.flops_counted // self.seq_len

    def flops_per_token_total(self, seq_len: int | None = None) -> int:
        return self.flops_per_token(seq_len)

    def flops_by_convention(self, seq_len: int | None = None) -> dict[str, int]:
        return {"counted": self.flops_per_token(seq_len)}

    def module(self) -> OwnModule:
        """A fresh instance of the model (the factory called again, on the current default device)."""
        return OwnModule(build(self.factory))

    def as_dict(self) -> dict:
        return {"name": self.name, "factory": self.factory, "params": self.params,
                "flops_per_token": self.flops_per_token(), "flops_convention": "counted (FlopCounterMode)",
                "vocab_size": self.vocab_size, "seq_len": self.seq_len, "block": self.block,
                "n_blocks": self.n_blocks, "arch": self.arch, "model": self.origin.as_dict()}


def _digest(spec: str) -> str:
    """sha256 over the factory's name and its module's source, 12 hex characters (a changed module is a new id)."""
    module = sys.modules.get(spec.partition(":")[0])
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = ""
    return hashlib.sha256((spec + "\n" + source).encode("utf-8")).hexdigest()[:12]


@lru_cache(maxsize=16)
def own_model(spec: str) -> OwnModel:
    """The factory's model, described and counted on the meta device (the factory runs there)."""
    with on_meta():
        built = build(spec)
    model, seq = built["model"], built["seq_len"]
    params = sum(p.numel() for p in model.parameters())
    flops = _counted_flops(model, built["vocab_size"], seq, spec)
    blocks = sum(isinstance(m, built["block"]) for m in model.modules())
    digest = _digest(spec)
    content = json.dumps({"factory": spec}, sort_keys=True)
    origin = ModelOrigin(kind="module", name=spec, digest=digest, content=content)
    func = spec.partition(":")[2]
    return OwnModel(name=f"{func}-{digest[:6]}", factory=spec, params=params, flops_counted=flops,
                    vocab_size=built["vocab_size"], seq_len=seq, block=built["block"].__qualname__, n_blocks=blocks,
                    has_tp_plan=built["tp_plan"] is not None, origin=origin)


def _counted_flops(model: nn.Module, vocab: int, seq: int, spec: str) -> int:
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415 (counting only)

    x = torch.zeros((1, seq), dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), x.reshape(-1)).backward()
    except Exception as e:  # the user's forward on the meta device: a refusal with its reason
        raise ConfigError(f"--model {spec}: its forward and backward on the meta device failed ({type(e).__name__}: "
                          f"{e}); the model must map (B, T) token ids to (B, T, vocab_size) logits") from None
    return int(counter.get_total_flops())


def module_from_origin(origin: dict[str, Any]) -> OwnModel:
    """A record's module model, by importing its factory again (the module must still be importable)."""
    return own_model(str(origin.get("name")))

"""The module tree on the meta device (workloads.meta.on_meta) is the real build's, with no initialiser run.

What the planner, the memory model and every CLI's prediction build to read shapes from: before, ``torch.device
("meta")`` alone ran ``nn.Embedding``'s ``normal_`` through its Python meta kernel, which imported dynamo (1.1-1.6 s
of each harness command's start-up on this CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from workloads.meta import VALUE_ONLY, on_meta
from workloads.model import Decoder
from workloads.sizes import get_size

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch", ["gpt2", "llama3", "moe"])
def test_the_meta_tree_has_the_real_build_s_parameters_and_buffers(arch):
    size = get_size("tiny", arch)
    real = Decoder(size)
    with on_meta():
        meta = Decoder(size)
    assert all(p.is_meta for p in meta.parameters())
    for kind in ("named_parameters", "named_buffers"):
        want = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in getattr(real, kind)()]
        got = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in getattr(meta, kind)()]
        assert got == want, kind


def test_only_value_writes_on_a_meta_tensor_are_skipped():
    cpu = torch.zeros(4)
    with on_meta():
        m = nn.Linear(3, 2)
        m.weight.requires_grad_(False)  # a flag: runs
        x = torch.empty(2, 3)
        x.unsqueeze_(0)  # a shape: runs
        nn.init.trunc_normal_(x)  # values on meta: skipped (its erfinv_ and clamp_ have Python meta kernels)
        cpu.normal_()  # a real tensor's values: written
    assert not m.weight.requires_grad
    assert tuple(x.shape) == (1, 2, 3) and x.is_meta
    assert cpu.abs().sum() > 0
    assert {"normal_", "erfinv_", "clamp_"} <= VALUE_ONLY and not VALUE_ONLY & {"unsqueeze_", "requires_grad_", "resize_"}


def test_a_prediction_s_shapes_import_no_dynamo():
    """In a fresh process, as in a CLI: the inventory and the memory model's linears of every family, and dynamo
    is still not imported (it was, by the first ``normal_`` on the meta device)."""
    code = ("import sys\n"
            "from harness.model.inventory import param_specs\n"
            "from harness.model.weight_copies import _linear_modules\n"
            "from workloads.sizes import get_size\n"
            "for arch in ('gpt2', 'llama3', 'moe'):\n"
            "    assert param_specs(get_size('mini', arch)) and _linear_modules(get_size('mini', arch))\n"
            "print('torch._dynamo' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"

"""One rank role of a cell: the real ``parallelize()`` and real training steps, memory measured.

``python -m harness.fit.role_process --spec SPEC.json --out RESULT.json`` plays global rank
``spec.rank`` of ``spec.world_size`` under the fake backend (collectives return at once, every
tensor has its real sharded shape). :func:`run_role` takes any initialised process group, so a
real gloo group runs the very same code (the distributed test compares the two).

The model is built on the meta device and parallelized there; only then is each rank's local
shard allocated (``to_empty``), so an ``xl`` rank at 1/64 never holds the whole model. With
``compute="fake"`` the steps run under ``FakeTensorMode``: every op allocates its real output
shapes and nothing is computed, for sizes whose real step would take this CPU hours.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.fit.role_spec import RoleSpec
from harness.measure.nvtx_ranges import Ranges
from harness.measure.rank_memory import model_state_bytes
from harness.measure.tensor_bytes import holding_tracker, optimizer_tensors
from harness.parallel.expert_load import moe_layers
from harness.parallel.levers import build_optimizer
from harness.parallel.parallelize import parallelize
from harness.parallel.pipeline import StageShapes, static_shapes
from harness.parallel.presets import resolve
from harness.precision import PrecisionPlan
from harness.records.atomic import write_json_atomic
from harness.run import train
from harness.spec import usable_cores
from workloads.model import Decoder, lm_loss
from workloads.own_model import OwnModel
from workloads.resolve import workload_of
from workloads.sizes import ModelSize


def _stage_shapes(spec: RoleSpec, size, layout, precision: PrecisionPlan) -> StageShapes | None:
    if not layout.dims.pp_enabled:
        return None
    return static_shapes(layout.dims, spec.micro_batch, spec.seq_len, size.d_model, size.vocab_size,
                         precision.autocast_dtype, layout.fsdp)


@torch.no_grad()
def _materialize(parts: list[nn.Module], device: torch.device, n_layers: int) -> None:
    """Allocate each rank's local shards on ``device`` and give them GPT-2-like values.

    The values only keep the arithmetic finite (the gathers of a fake group return garbage
    anyway); DTensor parameters are initialised shard by shard, with no collective.
    """
    for part in parts:
        part.to_empty(device=device)
        for name, p in part.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if p.dim() == 1:
                local.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                local.normal_(0.0, 0.02 / (math.sqrt(2 * n_layers) if name.endswith(("out.weight", "proj.weight"))
                                           else 1.0))


def _reduced_in_place(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP's comm hook under the fake backend: the bucket as if all-reduced. The fake all_reduce's
    future carries no tensor, which DDP's reducer rejects ("expected the hook result is either a
    Tensor or a TensorList found None"); the buckets themselves, what memory counts, are DDP's own."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def run_role(spec: RoleSpec, device: torch.device) -> dict:
    """Build, parallelize and step the cell on this (initialised) process group; what this rank measured."""
    workload = workload_of(spec.size, None, spec.model)
    size = cast(ModelSize, workload if isinstance(workload, OwnModel) else replace(workload, seq_len=spec.seq_len))
    layout = resolve(spec.strategy, spec.world_size, spec.degrees)
    dims = layout.dims
    dims.build_mesh(device.type)
    precision = PrecisionPlan(spec.precision)
    precision.configure_backends(spec.device_kind)
    torch.manual_seed(0)
    on_meta = layout.data_parallel != "ddp"  # DDP broadcasts real parameters when it wraps them
    with torch.device("meta" if on_meta else device):
        model = workload.module() if isinstance(workload, OwnModel) else Decoder(size)
    fake_group = dist.get_backend() == "fake"
    par = parallelize(model, layout, device, precision, pp_schedule=spec.pp_schedule, microbatches=spec.microbatches,
                      loss_fn=lm_loss,
                      stage_shapes=_stage_shapes(spec, size, layout, precision), ac=spec.ac,
                      ddp_comm_hook=_reduced_in_place if fake_group and layout.data_parallel == "ddp" else None)
    for _, layer in moe_layers(par.parts):  # fake tensors have no counts to read: an even (balanced) split
        layer.even_split = spec.compute == "fake"
    fake = FakeTensorMode(allow_non_fake_inputs=True) if spec.compute == "fake" else contextlib.nullcontext()
    with fake, _fused_attention(spec.compute):
        if on_meta:
            _materialize(par.parts, device, size.n_layers)
        params = [p for p in par.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, "adamw", 1e-4)
        ctx = train.StepContext(par=par, optimizer=optimizer, precision=precision,
                                scaler=precision.grad_scaler(spec.device_kind), device_kind=spec.device_kind,
                                grad_accum=1, ranges=Ranges(enabled=False))
        rows = spec.micro_batch * (spec.microbatches if dims.pp_enabled else 1)
        tracker = holding_tracker(par.parts, par.model)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with tracker:
            for _ in range(spec.steps):
                # a context-parallel rank holds 1 / cp of each sequence (harness.parallel.cp)
                x = torch.randint(0, size.vocab_size, (rows, spec.seq_len // dims.cp), device=device)
                train.train_step(ctx, x, x, 1e-4)
        state = model_state_bytes(par.parts, optimizer)
        tracker.hold(optimizer_tensors(optimizer))  # already counted unless the step skipped (no-op then)
    out = {"rank": spec.rank, "peak_bytes": tracker.peak_bytes, "peak_kind": "tensor_bytes",
           "model_state_bytes": state, "steps": spec.steps, "compute": spec.compute}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out.update(peak_bytes=torch.cuda.max_memory_allocated(), peak_kind="cuda_allocated",
                   tensor_bytes=tracker.peak_bytes)
    return out


def _fused_attention(compute: str):
    """Under fake compute, SDPA as a fused kernel (its output and log-sum-exp, no score matrix): fake tensors
    make SDPA pick its math path, which keeps the ``S x S`` scores no GPU kernel holds (flash attention;
    flash attention too for context parallel's chunks on a GPU, with its lower-right causal mask)."""
    if compute != "fake":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def run_fake(spec: RoleSpec) -> dict:
    """:func:`run_role` as rank ``spec.rank`` of a fake group of ``spec.world_size``, torn down after."""
    # Imported for its side effect: it registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415  (testing module, heavy)

    device = torch.device("cuda", 0) if spec.device_kind == "cuda" else torch.device("cpu")
    if spec.device_kind == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=spec.rank, world_size=spec.world_size)
    try:
        return run_role(spec, device)
    finally:
        dist.destroy_process_group()


def _child(spec: RoleSpec, conn) -> None:
    try:
        conn.send(("ok", run_fake(spec)))
    except BaseException as exc:  # reported to the parent, which raises it with the role named
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        conn.close()


def _start(spec: RoleSpec):
    """:func:`run_fake` in a forked child: a fresh process group and DTensor caches per role (torch's
    caches keyed by group name do not survive a destroyed group), at no interpreter start-up cost."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec, child), daemon=True)  # dies with this process
    proc.start()
    child.close()
    return parent, proc


def _finish(spec: RoleSpec, parent, proc) -> dict:
    try:
        status, payload = parent.recv()
    except EOFError:
        status, payload = "error", "the role process died without a result"
    proc.join()
    if status != "ok":
        raise RuntimeError(f"{spec.size} {spec.strategy} w{spec.world_size} rank {spec.rank}: {payload}")
    return payload


def _forked_all(specs: list[RoleSpec]) -> list[dict]:
    """Every spec in a forked child of its own (:func:`_start`), as many at once as this process
    may use cores; the results in the specs' order."""
    workers = usable_cores()
    results: list[dict] = [{} for _ in specs]
    pending = list(enumerate(specs))
    running: dict = {}  # the child's pipe -> (index, process)
    while pending or running:
        while pending and len(running) < workers:
            i, spec = pending.pop(0)
            parent, proc = _start(spec)
            running[parent] = (i, proc)
        for parent in multiprocessing.connection.wait(list(running)):
            i, proc = running.pop(parent)
            results[i] = _finish(specs[i], parent, proc)
    return results


def main(argv: list[str] | None = None) -> int:
    """One spec (``harness fit``: one role per process), or a list, as many at once as there are
    cores (:func:`_forked_all`; tests of model states)."""
    ap = argparse.ArgumentParser(prog="harness.fit.role_process")
    ap.add_argument("--spec", required=True, type=Path, help="a RoleSpec as JSON, or a list of them")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    raw = json.loads(args.spec.read_text())
    if isinstance(raw, list):
        write_json_atomic(args.out, _forked_all([RoleSpec.from_dict(d) for d in raw]))
    else:
        write_json_atomic(args.out, run_fake(RoleSpec.from_dict(raw)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

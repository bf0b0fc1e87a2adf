"""The ops one pass of a model runs, traced: every kernel of a block's forward, backward and recomputation, with its
FLOPs, the bytes it reads and writes, and what kind of kernel it is. The op-by-op what-if prices each
(:mod:`harness.model.op_cost`).

The trace runs the harness's own block (:class:`workloads.model.Block`, any architecture a config maps onto) under
``FakeTensorMode`` at its real widths, rows and sequence: no memory and no arithmetic, every op at its real shape. A
``TorchDispatchMode`` records each aten op below autograd and autocast, so what it sees is what eager PyTorch launches:
the casts autocast inserts, each composite op's pieces, the backward's kernels, and what a checkpointing policy runs
again (its block's forward wrapped so the recomputation is labelled as one). Views and allocations launch no kernel
and are left out.

Three kernels are stood in for, as they run on a GPU rather than as the CPU decomposes them:

* **attention** (``F.scaled_dot_product_attention``): one fused kernel (flash attention; the memory-efficient
  kernel where a mask is given), forward and backward. Its FLOPs are the kernel's: ``2 (E_qk + E_v)`` per query
  and key forward, ``2 (3 E_qk + 2 E_v)`` backward (it recomputes the scores), over the causal half where causal;
  its bytes its inputs, output and log-sum-exp (and backward's fp32 ``dq`` accumulator). The ``op`` policy keeps the
  attention's output, so its recomputation does not run it again;
* **RMSNorm** on a GPU whose input and weight share a dtype: torch's fused kernel (one read of the input, one write);
  otherwise its composite ops as traced (a GPU under autocast with fp32 weights runs those too).

Each op is attributed to the module that ran it (``attn.q``, ``mlp``, the block itself for the residual adds), in
the backward through the autograd node executing it, so tensor parallel can split each op as its module is split
(:mod:`harness.model.op_cost`). The casts autocast makes follow CPU autocast's op lists, which match CUDA's for
every op a block runs (matmuls low, norms, softmax and the loss fp32).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from harness.model.op_record import (
    ATTENTION,
    BACKWARD,
    FORWARD,
    MEMORY,
    RECOMPUTE,
    SYNC,
    Op,
    Recorder,
    dtype_name,
    storage_bytes,
)
from harness.parallel.activation_checkpoint import apply_ac
from harness.precision import Fp8Options, PrecisionPlan
from workloads.architecture import ModelSize
from workloads.model import Block, Decoder, lm_loss


@dataclass(frozen=True)
class _AttentionCall:
    rec: Recorder
    kv_scale: int
    """Keys per query over the local ones (context parallel's gathered keys)."""
    causal: bool
    keep_in_recompute: bool
    """The ``op`` policy keeps the attention's output: its recomputation does not run the kernel."""


class _Attention(torch.autograd.Function):
    """Fused attention, as a GPU runs it: one kernel each way, recorded with its FLOPs and bytes."""

    @staticmethod
    def forward(ctx: Any, call: _AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        rec, kv_scale, causal, keep_in_recompute = call.rec, call.kv_scale, call.causal, call.keep_in_recompute
        bh, tq, e_qk = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
        tk, e_v = k.shape[2] * kv_scale, v.shape[3]
        share = 0.5 if causal else 1.0  # a masked kernel computes the whole square
        ctx.rec, ctx.dims, ctx.share, ctx.kv_scale = rec, (bh, tq, tk, e_qk, e_v), share, kv_scale
        with rec.silent():
            out = q.new_empty((*q.shape[:3], e_v))
        inputs = [t for t in (q, k, v, mask) if t is not None]
        ctx.save_for_backward(q, k, v, out)
        ctx.mask = mask
        if not (rec.phase == RECOMPUTE and keep_in_recompute):
            lse = bh * tq * 4
            read = storage_bytes(q) + (storage_bytes(k) + storage_bytes(v)) * kv_scale + (storage_bytes(mask) if mask is not None else 0)
            rec.add("attention", ATTENTION, 2.0 * bh * tq * tk * (e_qk + e_v) * share, read, storage_bytes(out) + lse,
                    inputs, [out], dtype=dtype_name(q), attn=(bh, tq, tk, e_qk, e_v))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        rec: Recorder = ctx.rec
        q, k, v, out = ctx.saved_tensors
        bh, tq, tk, e_qk, e_v = ctx.dims
        with rec.silent():
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kv = (storage_bytes(k) + storage_bytes(v)) * ctx.kv_scale
        mask = ctx.mask
        lse = bh * tq * 4
        read = storage_bytes(q) + kv + storage_bytes(out) + storage_bytes(grad) + lse + (storage_bytes(mask) if mask is not None else 0)
        accum = 2 * bh * tq * e_qk * 4  # dq accumulated in fp32, written and read back
        rec.add("attention", ATTENTION, 2.0 * bh * tq * tk * (3 * e_qk + 2 * e_v) * ctx.share, read + accum,
                storage_bytes(dq) + kv + accum, [q, k, v, out, grad], [dq, dk, dv], dtype=dtype_name(q),
                attn=(bh, tq, tk, e_qk, e_v))
        return None, dq, dk, dv, None


class _FusedRMSNorm(torch.autograd.Function):
    """torch's fused RMSNorm (CUDA, input and weight of one dtype): one kernel each way."""

    @staticmethod
    def forward(ctx: Any, rec: Recorder, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        with rec.silent():
            y = torch.empty_like(x)
        ctx.rec, ctx.rows = rec, rows
        ctx.save_for_backward(x, weight)
        ins = [x] if weight is None else [x, weight]
        rec.add("rms_norm", MEMORY, 0.0, sum(storage_bytes(t) for t in ins), storage_bytes(y) + rows * 4, ins, [y])
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        rec: Recorder = ctx.rec
        x, weight = ctx.saved_tensors
        with rec.silent():
            dx = torch.empty_like(x)
            dw = torch.empty_like(weight) if weight is not None else None
        w = storage_bytes(weight) if weight is not None else 0
        rec.add("rms_norm_backward", MEMORY, 0.0, storage_bytes(grad) + storage_bytes(x) + ctx.rows * 4 + w, storage_bytes(dx) + w,
                [grad, x], [dx] + ([dw] if dw is not None else []))
        return None, dx, dw


def _install_stand_ins(root: nn.Module, rec: Recorder, kv_scale: int, fused_norm: bool, keep_attention: bool) -> None:
    """Attention, and RMSNorm on a GPU, as the kernels a GPU runs (the module docstring), set on the instances (a
    checkpointing policy's recomputation calls the same modules, so it runs them too)."""
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
        call = _AttentionCall(rec, kv_scale, causal=is_causal and attn_mask is None, keep_in_recompute=keep_attention)
        return _Attention.apply(call, q, k, v, attn_mask)

    for mod in root.modules():
        if hasattr(mod, "sdpa"):
            setattr(mod, "sdpa", attention)  # noqa: B010  (the instance's kernel: workloads.model._Positional.sdpa)
        if fused_norm and isinstance(mod, nn.RMSNorm):
            composite = mod.forward

            def norm(x: torch.Tensor, mod: nn.Module = mod, composite: Callable = composite) -> torch.Tensor:
                if mod.weight is None or mod.weight.dtype == x.dtype:
                    return _FusedRMSNorm.apply(rec, x, mod.weight)
                return composite(x)

            setattr(mod, "forward", norm)  # noqa: B010  (on the instance: a recomputation calls it too)


def _attach(rec: Recorder, root: nn.Module) -> list:
    """Forward hooks on every module: the stack names the module running each op; on the way out each autograd node
    the module made (those between its inputs and its outputs) is attributed to it unless an inner module claimed it
    first, so a node belongs to the innermost module that made it."""
    handles = []
    rec.linears = {name: (m.in_features, m.out_features) for name, m in root.named_modules() if isinstance(m, nn.Linear)}
    for name, mod in root.named_modules():
        def pre(_mod: nn.Module, args: tuple, name: str = name) -> None:
            rec.modules.append(name)
            rec.inputs.append({t.grad_fn for t in tree_leaves(args) if isinstance(t, torch.Tensor)})

        def post(_mod: nn.Module, _args: tuple, out: Any, name: str = name) -> None:
            rec.modules.pop()
            stop = rec.inputs.pop()
            stack = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            seen: set = set()
            while stack:
                node = stack.pop()
                if node is None or node in stop or node in seen:
                    continue
                seen.add(node)
                rec.node_module.setdefault(node, name)
                stack.extend(f for f, _ in node.next_functions if f is not None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


def _flag_recompute(rec: Recorder, fn: Callable) -> Callable:
    """``fn`` that labels what it runs in the backward (a checkpointing policy's recomputation) as such."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if rec.phase == FORWARD:
            return fn(*args, **kwargs)
        before, rec.phase = rec.phase, RECOMPUTE
        try:
            return fn(*args, **kwargs)
        finally:
            rec.phase = before

    return run


class _OneBlock(nn.Module):
    """A block as :func:`harness.parallel.activation_checkpoint.apply_ac` takes a model: its index in the whole."""

    def __init__(self, block: nn.Module, layer: int) -> None:
        super().__init__()
        self.block, self.layer = block, layer

    def block_items(self) -> list[tuple[str, nn.Module]]:
        return [(str(self.layer), self.block)]


class _RoutedEvenly:
    """An MoE layer's dispatch at a balanced load: the rows of this rank's ``E / ep`` experts, as many as it routed
    (under expert parallel each rank receives what it sends; the all-to-all itself is the comm model's). The layer
    reads its routed counts on the host (``counts.tolist()``, the all-to-all's split sizes): a sync."""

    def __init__(self, rec: Recorder, local_experts: int) -> None:
        self.rec, self.local = rec, local_experts

    def dispatch(self, grouped: torch.Tensor, counts: torch.Tensor, even: bool) -> tuple[torch.Tensor, list[int], None]:
        self.rec.add("counts.tolist", SYNC, 0.0, 0, 0, [], [])
        q, r = divmod(grouped.shape[0], self.local)
        return grouped, [q + 1] * r + [q] * (self.local - r), None

    def combine(self, y: torch.Tensor, state: None) -> torch.Tensor:
        return y


@dataclass(frozen=True)
class TraceSpec:
    """What a traced pass depends on."""

    rows: int
    """Sequences in the microbatch."""
    seq: int
    """Tokens of each sequence this rank holds (``seq / cp`` under context parallel)."""
    precision: str = "bf16"
    low_params: bool = False
    """FSDP's low-precision parameters (``param_dtype``): weights gathered in the low dtype, nothing to cast."""
    recompute: str = "none"
    fused_norm: bool = True
    """A GPU's fused RMSNorm (CPU ranks decompose it)."""
    cp: int = 1
    """Context parallel: each query attends over ``cp`` times the local keys (gathered)."""
    ep: int = 1
    fp8_recipe: str = "tensorwise"
    """``fp8``: torchao's recipe its float8 linears run (when torchao is installed; else no float8 in the trace)."""


_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def _autocast(precision: str) -> contextlib.AbstractContextManager:
    low = _AUTOCAST.get(precision)
    return torch.autocast("cpu", dtype=low) if low is not None else contextlib.nullcontext()


def fp8_traced() -> bool:
    """Whether the trace runs fp8's linears as torchao does (torchao installed): their casts and scales as the ops
    they are, their matmuls in float8."""
    return importlib.util.find_spec("torchao") is not None


def _convert_fp8(block: nn.Module, spec: TraceSpec) -> None:
    """``fp8``: the block's eligible linears as torchao's float8 training linears, as the harness converts them
    (:meth:`harness.precision.PrecisionPlan.convert_linears`), not emulated: the trace sees the float8 matmuls."""
    if spec.precision != "fp8" or not fp8_traced():
        return
    PrecisionPlan("fp8", Fp8Options(recipe=spec.fp8_recipe)).convert_linears(block)


@contextlib.contextmanager
def _param_dtype(spec: TraceSpec) -> Iterator[None]:
    """Parameters made in FSDP's low-precision ``param_dtype`` (fp32 otherwise), as its all-gather delivers them."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(_AUTOCAST.get(spec.precision, torch.float32) if spec.low_params else torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _run(rec: Recorder, root: nn.Module, spec: TraceSpec, forward: Callable[[], torch.Tensor],
         keep_attention: bool) -> None:
    _install_stand_ins(root, rec, spec.cp, spec.fused_norm, keep_attention)
    with rec, _autocast(spec.precision):
        out = forward()
    rec.phase = BACKWARD
    with rec:
        out.backward(torch.empty_like(out) if out.dim() else None)


def fake_block(size: ModelSize, layer: int, spec: TraceSpec, rec: Recorder) -> Block:
    """Block ``layer`` as a rank runs it, made under the caller's ``FakeTensorMode``: parameters in FSDP's
    ``param_dtype`` where it gathers low, fp8's linears torchao's, an MoE's dispatch at a balanced load (its host
    sync recorded in ``rec``). No checkpointing policy yet: the caller applies it."""
    with _param_dtype(spec):
        block = Block(size, layer)
    _convert_fp8(block, spec)
    if size.moe is not None and hasattr(block.mlp, "dispatcher"):
        setattr(block.mlp, "dispatcher", _RoutedEvenly(rec, size.moe.n_experts // spec.ep))  # noqa: B010
    return block


def residual_dtype(spec: TraceSpec) -> torch.dtype:
    """The residual stream's dtype between blocks: fp32, or FSDP's low ``param_dtype``."""
    return _AUTOCAST.get(spec.precision, torch.float32) if spec.low_params else torch.float32


def trace_autocast(spec: TraceSpec) -> contextlib.AbstractContextManager:
    """The autocast a traced forward runs under (CPU autocast's op lists match CUDA's for a block's ops)."""
    return _autocast(spec.precision)


@functools.lru_cache(maxsize=512)
def trace_block(size: ModelSize, layer: int, spec: TraceSpec) -> tuple[Op, ...]:
    """The kernels of block ``layer``'s forward and backward (and recomputation) over one microbatch on one rank, at
    tensor parallel 1: :mod:`harness.model.op_cost` splits them as tensor parallel would."""
    rec = Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        block = fake_block(size, layer, spec, rec)
        handles = _attach(rec, block)
        setattr(block, "forward", _flag_recompute(rec, block.forward))  # noqa: B010  (before apply_ac wraps it)
        core = getattr(block.attn, "core", None)
        if core is not None:
            setattr(block.attn, "core", _flag_recompute(rec, core))  # noqa: B010
        apply_ac(_OneBlock(block, layer), spec.recompute)  # type: ignore[arg-type]
        x = torch.empty(spec.rows, spec.seq, size.d_model, dtype=residual_dtype(spec), requires_grad=True)
        _run(rec, block, spec, lambda: block(x), keep_attention=spec.recompute == "op")
        for h in handles:
            h.remove()
    return tuple(rec.ops)


@functools.lru_cache(maxsize=16)
def optimizer_bytes_per_param(kind: str = "adamw") -> float:
    """Bytes one AdamW step moves per parameter, traced on a fake fp32 parameter as a GPU runs it: torch's default
    multi-tensor (``foreach``) kernels, or the fused kernel (``adamw-fused``)."""
    rec = Recorder()
    n = 1 << 20
    with FakeTensorMode(allow_non_fake_inputs=True):
        p = nn.Parameter(torch.empty(n))
        p.grad = torch.empty(n)
        fused = kind == "adamw-fused"
        opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, foreach=not fused, fused=fused)
        opt.step()  # the first step makes the state
        with rec:
            opt.step()
    return sum(o.bytes for o in rec.ops) / n


@functools.lru_cache(maxsize=128)
def trace_ends(size: ModelSize, spec: TraceSpec) -> tuple[Op, ...]:
    """The kernels outside the blocks: the embedding (module ``embed``), the final norm (``norm``), the LM head
    (``head``) and the loss (``""``), forward and backward, over one microbatch at tensor parallel 1."""
    rec = Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        with _param_dtype(spec):
            model = Decoder(replace(size, n_layers=1, dense_layers=min(size.dense_layers, 1)))
        model.blocks = nn.ModuleDict()
        handles = _attach(rec, model)
        idx = torch.zeros(spec.rows, spec.seq, dtype=torch.long)
        _run(rec, model, spec, lambda: lm_loss(model(idx), idx), keep_attention=False)
        for h in handles:
            h.remove()
    return tuple(replace(o, module=o.module or "loss") for o in rec.ops)

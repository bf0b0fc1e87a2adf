"""``harness calibrate``: matmul peak, collective bus bandwidth and workload passes, into the store."""

from __future__ import annotations

import argparse
import statistics

import torch
from tabulate import tabulate

from harness.calibration import matmul, ops, storage, store
from harness.calibration.collectives import (
    COLLECTIVES,
    COMM_MAX_BYTES,
    COMM_MIN_BYTES,
    bus_factor,
    calibrate_comm,
    human_bytes,
    lookup_comm,
    parse_size,
)
from harness.calibration.provenance import label_of
from harness.calibration.workload import calibrate_workload, lookup_workload
from harness.cli.arg_values import csv_list, int_arg, models_arg, path_arg
from harness.cli.args import Settings
from harness.errors import UsageError
from harness.parallel.levers import check_levers
from harness.spec import default_device_kind, usable_cores
from workloads.sizes import ModelSize, get_size, seq_len_error


def _size(name: str, v: str) -> int:
    try:
        return parse_size(v)
    except ValueError as e:
        raise UsageError(f"--{name} {e}") from None


def _workload_args(args: argparse.Namespace, device: str) -> list[tuple[ModelSize, int]]:
    """(workload, seq_len) pairs for the workload calibration: the named sizes and the ``--model`` ones (shrunk on
    CPU unless ``--full-size``, as bench runs them); checked before anything runs."""
    sizes = []
    for name in csv_list(args.workloads or ""):
        try:
            sizes.append(get_size(name))
        except ValueError as e:
            raise UsageError(f"--workloads: {e}") from None
    for m in models_arg(Settings({k: v for k, v in (("model", args.model), ("full_size", args.full_size))
                                  if v is not None}), device):
        if not isinstance(m, ModelSize):
            raise UsageError(f"--model {m.factory}: a module of your own is not calibrated (its step time is not "
                             f"priced: the analytic model prices the harness's own layers)")
        sizes.append(m)
    out = []
    for size in sizes:
        seq = int_arg("--seq-len", args.seq_len, 1) if args.seq_len is not None else size.seq_len
        if error := seq_len_error(size, seq):
            raise UsageError(f"--seq-len: {error}")
        out.append((size, seq))
    return out


def _comm_args(args: argparse.Namespace, device: str) -> tuple[int, int, int] | None:
    """(ranks, min_bytes, max_bytes) for the comm calibration, None for one rank; checked before anything runs."""
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA GPU is visible; use --device cpu or auto")
    n = int_arg("--gpus", args.gpus, 1) if args.gpus is not None else torch.cuda.device_count() if cuda else 2
    if cuda and n > torch.cuda.device_count():
        raise UsageError(f"--gpus {n}: only {torch.cuda.device_count()} CUDA devices are visible; "
                         f"choose --gpus <= {torch.cuda.device_count()}")
    lo = _size("comm-min-bytes", args.comm_min_bytes) if args.comm_min_bytes else COMM_MIN_BYTES
    hi = _size("comm-max-bytes", args.comm_max_bytes) if args.comm_max_bytes else COMM_MAX_BYTES
    if lo > hi:
        raise UsageError(f"--comm-min-bytes ({lo}) must be <= --comm-max-bytes ({hi}); lower the first or raise the second")
    return None if n == 1 else (n, lo, hi)


def _forced(v: str | None) -> frozenset[str]:
    """The kinds ``--force`` re-measures: all with no value, else a comma list of kinds."""
    if v is None:
        return frozenset()
    kinds = csv_list(v)
    for k in kinds:
        if k not in store.KINDS:
            raise UsageError(f"--force {k!r}: choose from {', '.join(store.KINDS)}, a comma list of them, or none "
                             f"(every kind), e.g. --force workload")
    return frozenset(kinds or store.KINDS)


def _origin(stored: dict | None, forced: bool, e: dict) -> str:
    """Whether a calibration was served from the store, measured now, or measured again over a stored
    one; with its repeats' spread, and a flag when it is unsteady."""
    spread = (e.get("spread") or {}).get("ratio")
    steady = f", repeats spread {spread:.3g}x" if spread is not None else ""
    if e.get("unsteady"):
        steady += f", UNSTEADY ({e.get('unsteady_reason')}): predictions from it are flagged; re-measure with --force"
    if stored is not None and not forced:
        return f"(cached, measured {e.get('measured_at', '?')}{steady})"
    return f"(measured now{steady})"


def _said_forced(kind: str, stored: dict | None, forced: frozenset[str]) -> None:
    """One line when ``--force`` replaced a stored entry."""
    if stored is not None and kind in forced:
        fp = stored["fingerprint"]
        print(f"re-measured (--force): {label_of(kind, fp)} (the stored entry was measured "
              f"{stored.get('measured_at', 'at an unknown time')})")


def _print_workload(e: dict, threads: int, origin: str) -> None:
    passes = ", ".join(f"{r}: {t * 1e3:.1f} ms" for r, t in zip(e["rows"], e["pass_s"]))
    compiled = " compiled" if e["fingerprint"].get("compile") else ""
    print(f"workload {e['size']} seq {e['seq_len']} {e['dtype']} threads={threads} x {e['fingerprint']['concurrent']} "
          f"at once{compiled}: forward+backward {passes}; "
          f"fit alpha {e['alpha_s'] * 1e3:.1f} ms + {e['beta_s_per_row'] * 1e3:.1f} ms/sequence; "
          f"AdamW step {e['optimizer_s'] * 1e3:.1f} ms for {e['params']:,} params {origin}")


def _print_comm(e: dict, n: int) -> None:
    fp = e["fingerprint"]
    threads = f", {fp['threads_per_rank']} threads/rank" if fp["threads_per_rank"] else ""
    print(f"\ncomm: {n} ranks, {fp['backend']}{threads}, measured {e['measured_at']}")
    for name in (c for c in COLLECTIVES if c in e["collectives"]):  # the cache file's keys are sorted
        rows, s = e["collectives"][name], e["summary"][name]
        print(f"\n{name} (busbw = algbw x {bus_factor(name, n):.3g}): peak busbw {s['peak_busbw_gbps']:.4g} GB/s, "
              f"latency {s['latency_s'] * 1e6:.1f} us")
        print(tabulate([[human_bytes(r["bytes"]), r["time_s"] * 1e6, r["algbw_gbps"], r["busbw_gbps"]] for r in rows],
                       headers=["bytes", "time us", "algbw GB/s", "busbw GB/s"], tablefmt="github", floatfmt=("", ".1f", ".4g", ".4g")))
    print(f"\nsynchronisation cost of a collective after compute: {e['sync_s'] * 1e6:.0f} us per call "
          f"(added to every blocking collective by the performance model)")
    print(f"\ncomm cache: {store.default_path()}")


def _print_ops(e: dict, origin: str) -> None:
    print(f"\nops on {e['fingerprint']['device_name']} {origin}: copy {e['bandwidth_gbps']:.4g} GB/s, "
          f"eager launch {e['launch_s'] * 1e6:.1f} us per op, kernel floor {e['kernel_floor_s'] * 1e6:.2f} us")
    print(tabulate([[g["dtype"], f"{g['m']}x{g['n']}x{g['k']}", g["tflops"]] for g in e["gemms"]],
                   headers=["dtype", "m x n x k", "TFLOP/s"], tablefmt="github", floatfmt=("", "", ".4g")))
    print(tabulate([[a["head_dim"], a["seq"], a["fwd_tflops"], a["fwd_bwd_tflops"]] for a in e["attention"]],
                   headers=["head dim", "seq", "attention fwd TFLOP/s", "fwd+bwd TFLOP/s"], tablefmt="github",
                   floatfmt=("", "", ".4g", ".4g")))


def cmd_calibrate(args: argparse.Namespace) -> int:
    device = default_device_kind() if args.device == "auto" else args.device
    threads = args.threads or usable_cores()
    for dt in csv_list(args.dtype):
        if dt not in matmul.DTYPES or (dt == "tf32" and device != "cuda"):
            raise UsageError(f"--dtype {dt!r}: choose from fp32,bf16,fp16 (tf32 on GPU only)")
    comm = None if args.no_comm else _comm_args(args, device)
    workloads = _workload_args(args, device)
    concurrent = int_arg("--concurrent", args.concurrent, 1) if args.concurrent is not None else 1
    if args.compile:
        if not workloads:
            raise UsageError("--compile times compiled workload passes: name the sizes with --workloads (or --model), e.g. "
                             "--workloads tiny --compile")
        check_levers(device, tp_enabled=False, warmup=1, compile=True, ac="none", optimizer="adamw")
    forced = _forced(args.force)
    path = store.default_path()
    why = store.unwritable(path)
    if why is not None:
        raise UsageError(f"calibration store {path} is not writable ({why}); set {store.ENV}=FILE to a writable "
                         f"path, e.g. {store.ENV}=./calibration.json")
    for dt in csv_list(args.dtype):
        stored = matmul.lookup(device, dt, threads)
        e = matmul.calibrate(device, dt, threads, force="matmul" in forced)
        _said_forced("matmul", stored, forced)
        median = e.get("median_tflops") or statistics.median(s["tflops"] for s in e["shapes"])  # older cache entries
        ref = e.get("reference_tflops")
        plain = f", plain {'x'.join(map(str, e['reference_shape']))} {ref:.4g}" if ref else ""
        print(f"{device} {dt} threads={threads if device == 'cpu' else '-'}: {e['tflops']:.4g} TFLOP/s max, "
              f"{median:.4g} median over {len(e['shapes'])} shapes (best shape {e['best_shape']}{plain}) "
              f"{_origin(stored, 'matmul' in forced, e)} -> {path}")
    for size, seq in workloads:
        for dt in csv_list(args.dtype):
            th = threads if device == "cpu" else 0
            stored = lookup_workload(device, size.key, seq, dt, th, concurrent, compiled=args.compile)
            e = calibrate_workload(device, size, seq, dt, th, concurrent=concurrent, force="workload" in forced,
                                   compiled=args.compile)
            _said_forced("workload", stored, forced)
            _print_workload(e, threads, _origin(stored, "workload" in forced, e))
    if comm is not None:
        n, lo, hi = comm
        stored = lookup_comm(device, n)
        e = calibrate_comm(device, n, lo, hi, force="comm" in forced)
        _said_forced("comm", stored, forced)
        _print_comm(e, n)
    elif not args.no_comm:
        print("comm: n/a: bus bandwidth needs >= 2 ranks")
    if args.ops:
        stored = ops.lookup(device)
        e = ops.calibrate(device, force="ops" in forced)
        _said_forced("ops", stored, forced)
        _print_ops(e, _origin(stored, "ops" in forced, e))
    if args.storage is not None:
        stored = storage.lookup(args.storage)
        e = storage.calibrate(args.storage, force="storage" in forced)
        _said_forced("storage", stored, forced)
        print(f"{label_of('storage', e['fingerprint'])}: write {e['write_gbps']:.4g} GB/s (fsync-ed), read "
              f"{e['read_gbps']:.4g} GB/s, {e['bytes'] / 2**20:.0f} MiB x {len(e['repeats']['write'])} "
              f"{_origin(stored, 'storage' in forced, e)}")
    return 0


def register(sub) -> None:
    k = sub.add_parser("calibrate", help="measure the matmul peak (TFLOP/s) per dtype and the collective bus "
                                         "bandwidth, and cache them")
    k.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    k.add_argument("--dtype", default="fp32")
    k.add_argument("--threads", type=int, help="CPU threads for the matmul (default: the cores this process may use, its CPU affinity)")
    k.add_argument("--force", nargs="?", const="", metavar="KINDS",
                   help="re-measure even if cached: every kind, or only the listed ones (matmul,workload,comm)")
    k.add_argument("--gpus", help="ranks for the bus-bandwidth measurement (default: all GPUs; 2 on CPU; 1 skips it)")
    k.add_argument("--no-comm", action="store_true", help="matmul peak only")
    k.add_argument("--comm-min-bytes", help="smallest message, e.g. 4KiB (default 4KiB)")
    k.add_argument("--comm-max-bytes", help="largest message, e.g. 64MiB (default 64MiB)")
    k.add_argument("--workloads", help="sizes whose forward+backward and optimizer step to time for the "
                                       "performance model, e.g. tiny,small (another family by key: llama3-tiny)")
    k.add_argument("--model", help="--workloads of your own: a config.json (or a folder holding one), a list times "
                                   "each; shrunk on CPU as bench runs it unless --full-size")
    k.add_argument("--full-size", action="store_true", default=None, help="--model as given, not shrunk")
    k.add_argument("--seq-len", help="sequence length for --workloads (default: the size's)")
    k.add_argument("--concurrent", help="--workloads: copies measured at once, as many as a node's ranks (default 1)")
    k.add_argument("--compile", action="store_true",
                   help="--workloads: time the passes with each block torch.compile'd, as --compile on cells run")
    k.add_argument("--ops", action="store_true",
                   help="also what plan's op-by-op pricing needs on this device: GEMMs at the models' shapes, flash "
                        "attention by length and head width, copy bandwidth, eager launch time, kernel floor")
    k.add_argument("--storage", type=path_arg, metavar="DIR",
                   help="also the write and read bandwidth of DIR's filesystem (what a checkpoint's save is priced "
                        "at; harness bench measures its run directory's when a cell checkpoints)")
    k.set_defaults(fn=cmd_calibrate)

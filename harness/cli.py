"""Command line: ``harness {bench,plan,report,compare,calibrate,workloads,trace,slurm}``.

Bad input is one line on stderr naming the value and the fix, exit code 2, before anything
is launched or written. Precedence: CLI flags > sweep file (TOML) > defaults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tomllib
from pathlib import Path

from harness.errors import UsageError

EXIT_USAGE = 2
COMM_MIN_BYTES = 4 << 10
COMM_MAX_BYTES = 64 << 20
"""Default message sizes of the bus-bandwidth calibration: DDP's 25 MiB buckets and FSDP groups fall inside."""
RUN_DEVICES = ("auto", "cpu", "cuda")
"""``--device`` values a sweep can run on; ``harness plan`` also takes hardware presets (what-if)."""


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def _ints(name: str, s: str, minimum: int = 1) -> tuple[int, ...]:
    out = []
    for x in _csv(str(s)):
        if not x.lstrip("-").isdigit() or int(x) < minimum:
            raise UsageError(f"--{name} {s!r}: each value must be an integer >= {minimum}, e.g. --{name} 2 or 1,2,4")
        out.append(int(x))
    if not out:
        raise UsageError(f"--{name} is empty; give an integer >= {minimum}")
    return tuple(out)


def _int(name: str, v, minimum: int) -> int:
    s = str(v).strip()
    if not s.lstrip("-").isdigit() or int(s) < minimum:
        raise UsageError(f"--{name} {v!r}: must be an integer >= {minimum}")
    return int(s)


def _degrees(s: str | None) -> dict | None:
    if not s:
        return None
    out = {}
    for part in _csv(s):
        k, _, v = part.partition("=")
        if not v.isdigit():
            raise UsageError(f"--degrees {s!r}: expected name=int pairs like pp=2,tp=2")
        out[k.strip()] = int(v)
    return out


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep matrix")
    g.add_argument("--sweep", type=Path, help="TOML sweep file; flags given on the command line override it")
    g.add_argument("--gpus", help="devices per node (CPU ranks without a GPU); a list sweeps device counts: 1,2,4")
    g.add_argument("--sizes", help="workload sizes (harness workloads lists them)")
    g.add_argument("--strategies", help="single,ddp,fsdp,zero2,hsdp,tp,tp-sp,pp,fsdp+tp,pp+fsdp,pp+fsdp+tp")
    g.add_argument("--precision", help="fp32,tf32,bf16,fp16")
    g.add_argument("--scaling", help="strong (fixed global batch) or weak (fixed per-device batch)")
    g.add_argument("--lr-rule", help="none,linear,sqrt: LR scaling relative to --base-batch")
    g.add_argument("--batch", help="sequences per step: global (strong) or per device (weak)")
    g.add_argument("--seq-len", help="tokens per sequence (default: the size's)")
    g.add_argument("--steps", help="measured steps")
    g.add_argument("--warmup", help="unmeasured steps first")
    g.add_argument("--microbatches", help="pipeline microbatches (default 2 x pp)")
    g.add_argument("--pp-schedule", help="gpipe, 1f1b or interleaved1f1b")
    g.add_argument("--grad-accum", help="gradient-accumulation micro-steps (non-pipeline)")
    g.add_argument("--base-lr", help="LR at --base-batch")
    g.add_argument("--base-batch", help="global batch at which --base-lr holds (default: --batch)")
    g.add_argument("--warmup-steps", help="linear LR warmup steps (Goyal et al. 2017)")
    g.add_argument("--seed")
    g.add_argument("--target-loss", help="loss for steps-to-target (default: entropy floor + 0.5 nats)")
    g.add_argument("--degrees", help="explicit degrees overriding the presets, e.g. pp=2,tp=2")
    g.add_argument("--device", default=None,
                   help="auto (default), cpu or cuda; harness plan also takes a hardware preset "
                        "(h100, h100-pcie, h200, a100) for a what-if prediction")
    g.add_argument("--nvtx", choices=("on", "off"), default=None, help="NVTX ranges (default on)")
    g.add_argument("--profile", action="store_true", default=None, help="torch.profiler traces per rank")
    g.add_argument("--mem-cap-gib", help="CPU: cap each rank's memory growth; over it the cell is oom")
    g.add_argument("--no-reference", action="store_true", default=None,
                   help="do not add the single-device reference cell used for parity")
    g.add_argument("--nnodes", help="machines in the job (torchrun rendezvous at --rdzv-endpoint, node rank 0 hosts it)")


DEFAULTS = {
    "cpu": dict(sizes="tiny", precision="fp32", batch=8, steps=20, warmup=3),
    "cuda": dict(sizes="small", precision="bf16", batch=8, steps=30, warmup=5),
}


def _merged(args: argparse.Namespace) -> dict:
    """CLI > sweep file > defaults."""
    file_vals: dict = {}
    if getattr(args, "sweep", None):
        try:
            file_vals = tomllib.loads(args.sweep.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise UsageError(f"--sweep {args.sweep}: cannot read TOML ({e}); fix the file") from None
        file_vals = {k.replace("-", "_"): v for k, v in file_vals.items()}
    cli = {k: v for k, v in vars(args).items() if v is not None}
    merged = {**file_vals, **cli}
    for k, v in list(merged.items()):
        if isinstance(v, list):
            merged[k] = ",".join(map(str, v))
    return merged


def spec_from_args(args: argparse.Namespace):
    from harness.plan import SweepSpec, default_device_kind
    from harness.parallel.presets import STRATEGIES

    v = _merged(args)
    device = v.get("device", "auto")
    if device not in RUN_DEVICES:
        from harness.model.hardware import DEVICES

        hint = (f"{device!r} is a hardware preset: harness plan --device {device} predicts from it; "
                if str(device).lower() in DEVICES else f"{device!r}: ")
        raise UsageError(f"--device {hint}runs need auto, cpu or cuda")
    if device == "auto":
        device = default_device_kind()
    elif device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA GPU is visible; use --device cpu or auto")
    d = DEFAULTS[device]
    gpus = _ints("gpus", v.get("gpus", 1))
    strategies = v.get("strategies") or ("single" if max(gpus) == 1 else ",".join(STRATEGIES))
    return SweepSpec(
        sizes=_csv(v.get("sizes", d["sizes"])),
        strategies=_csv(strategies),
        precisions=_csv(v.get("precision", d["precision"])),
        gpus=gpus,
        device_kind=device,
        batch=_int("batch", v.get("batch", d["batch"]), 1),
        steps=_int("steps", v.get("steps", d["steps"]), 1),
        warmup=_int("warmup", v.get("warmup", d["warmup"]), 0),
        scalings=_csv(v.get("scaling", "strong")),
        lr_rules=_csv(v.get("lr_rule", "none")),
        seq_len=_int("seq-len", v["seq_len"], 1) if "seq_len" in v else None,
        microbatches=_int("microbatches", v["microbatches"], 1) if "microbatches" in v else None,
        pp_schedule=v.get("pp_schedule", "1f1b"),
        grad_accum=_int("grad-accum", v.get("grad_accum", 1), 1),
        base_lr=_float("base-lr", v.get("base_lr", 1e-3)),
        base_batch=_int("base-batch", v["base_batch"], 1) if "base_batch" in v else None,
        lr_warmup_steps=_int("warmup-steps", v.get("warmup_steps", 0), 0),
        seed=_int("seed", v.get("seed", 0), 0),
        target_loss=_float("target-loss", v["target_loss"]) if "target_loss" in v else None,
        nnodes=_int("nnodes", v.get("nnodes", 1), 1),
        nvtx=v.get("nvtx", "on") == "on",
        profile=bool(v.get("profile", False)),
        mem_cap_gib=_float("mem-cap-gib", v["mem_cap_gib"]) if "mem_cap_gib" in v else None,
        degrees=_degrees(v.get("degrees")),
        reference=not v.get("no_reference", False),
    )


def _float(name: str, v) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise UsageError(f"--{name} {v!r}: expected a number") from None
    if x <= 0:
        raise UsageError(f"--{name} {v!r}: must be > 0")
    return x


def _device_line(spec) -> str:
    if spec.device_kind == "cpu":
        return (f"device: cpu (no GPU in use): --gpus {','.join(map(str, spec.gpus))} means CPU ranks on gloo; "
                f"CPU-sized defaults (sizes {','.join(spec.sizes)})")
    import torch

    return f"device: cuda ({torch.cuda.get_device_name()}), NCCL"


def add_whatif_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what-if (--device h100|h100-pcie|h200|a100: predict, do not run)")
    g.add_argument("--recompute", choices=("none", "selective", "full"), default=None,
                   help="activation recomputation (default none)")
    g.add_argument("--efficiency", help="compute rate as a fraction of the datasheet peak, in (0, 1] "
                                        "(default: MAMF x kernel efficiency measured on one H200)")
    g.add_argument("--error-from", type=Path, default=None,
                   help="run directory whose records carry predictions, for the model's measured error "
                        "(default results/reference/model-cpu-w2-w4)")


ERROR_FROM = Path("results/reference/model-cpu-w2-w4")


def cmd_plan_whatif(args) -> int:
    """``harness plan --device PRESET``: rank strategies by predicted tokens/s per device."""
    from harness.model.hardware import get_device
    from harness.model.whatif import model_error, plan_at_scale, scenario
    from harness.report_whatif import BANNER, assumptions_lines, error_line, whatif_table

    v = _merged(args)
    device = get_device(v["device"])
    if "nnodes" in v:
        raise UsageError(f"--nnodes {v['nnodes']}: the what-if takes --gpus as the total and fills nodes of "
                         f"{device.gpus_per_node} ({device.name}); drop --nnodes")
    if "gpus" not in v:
        raise UsageError(f"--device {device.name} predicts at a device count: give --gpus N, e.g. --gpus 64")
    if v.get("scaling", "strong") != "strong":
        raise UsageError(f"--scaling {v['scaling']}: the what-if takes --batch as the global batch; drop --scaling")
    efficiency = _fraction("efficiency", v["efficiency"]) if "efficiency" in v else None
    sizes = _csv(v.get("sizes", "xl"))
    strategies = _csv(v["strategies"]) if v.get("strategies") else None
    opts = dict(global_batch=_int("batch", v["batch"], 1) if "batch" in v else None,
                seq_len=_int("seq-len", v["seq_len"], 1) if "seq_len" in v else None,
                recompute=v.get("recompute", "none"),
                microbatches=_int("microbatches", v["microbatches"], 1) if "microbatches" in v else None,
                efficiency=efficiency, pp_schedule=v.get("pp_schedule", "1f1b"),
                grad_accum=_int("grad-accum", v.get("grad_accum", 1), 1), degrees=_degrees(v.get("degrees")))
    sections = [(size, prec, gpus) for size in sizes for prec in _csv(v.get("precision", "bf16"))
                for gpus in _ints("gpus", v["gpus"])]
    for size, prec, gpus in sections:  # every value is checked before anything is printed
        scenario(size, device, gpus, prec, **opts)
    run_dir = args.error_from or ERROR_FROM
    print(BANNER)
    for size, prec, gpus in sections:
        print()
        print("\n".join(assumptions_lines(scenario(size, device, gpus, prec, **opts))))
        print()
        print(whatif_table(plan_at_scale(size, device, gpus, strategies, prec, **opts)))
    print()
    print(error_line(model_error(run_dir), run_dir))
    return 0


def _fraction(name: str, v) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise UsageError(f"--{name} {v!r}: expected a fraction in (0, 1], e.g. 0.4") from None
    if not 0 < x <= 1:
        raise UsageError(f"--{name} {v!r}: must be a fraction of the datasheet peak in (0, 1], e.g. 0.4")
    return x


def cmd_plan(args) -> int:
    from harness.plan import expand
    from harness.report_plan import plan_table

    if _merged(args).get("device", "auto") not in RUN_DEVICES:
        return cmd_plan_whatif(args)
    for flag in ("recompute", "efficiency", "error_from"):
        if getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} applies to a what-if only: add --device h100 "
                             f"(or h100-pcie, h200, a100)")
    spec = spec_from_args(args)
    cells = expand(spec)
    print(_device_line(spec))
    print(plan_table(cells))
    return 0


def _check_valid_any(cells) -> None:
    """Nothing is launched when no cell the user asked for is valid (the parity reference doesn't count)."""
    asked = [c for c in cells if not c.reference_only]
    if not any(c.valid for c in asked):
        bad = [c for c in asked if not c.valid]
        if len(bad) == 1:
            raise UsageError(bad[0].reason)
        raise UsageError("no valid cell to run: " + "; ".join(f"{c.cell_id}: {c.reason}" for c in bad))


def cmd_bench(args) -> int:
    from harness.launch import Rendezvous
    from harness.plan import expand
    from harness.sweep import (SweepOptions, calibration_record, restore_sweep_args, run_sweep, save_sweep_args,
                               start_run)

    if args.resume is not None:
        restore_sweep_args(args.resume, args)  # `--resume DIR` alone re-plans the run's cells; flags given win
    spec = spec_from_args(args)
    if args.node_rank is not None and not 0 <= args.node_rank < spec.nnodes:
        raise UsageError(f"--node-rank {args.node_rank} must be in [0, {spec.nnodes - 1}] for --nnodes {spec.nnodes}")
    if spec.nnodes > 1 and not args.rdzv_endpoint:
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the node-rank-0 machine)")
    cells = expand(spec)
    if args.resume is None:
        _check_valid_any(cells)
    if args.cell_timeout is not None and args.cell_timeout <= 0:
        raise UsageError(f"--cell-timeout {args.cell_timeout}: must be > 0 seconds")
    node_rank = args.node_rank or 0
    out, run_id, resume = start_run(args.out, args.resume, node_rank)
    if node_rank == 0 and not resume:
        save_sweep_args(out, args)
    print(_device_line(spec), flush=True)
    print(f"run {run_id}: {sum(c.valid for c in cells)} cells to run, {sum(not c.valid for c in cells)} invalid -> {out}",
          flush=True)
    if node_rank == 0:
        if not args.no_calibrate:
            _auto_calibrate(spec)
        if not resume:
            from harness.results.atomic import append_jsonl

            append_jsonl(out / "records.jsonl", calibration_record(run_id, spec.device_kind))
    rdzv = Rendezvous(nnodes=spec.nnodes, node_rank=node_rank, endpoint=args.rdzv_endpoint)
    opts = SweepOptions(out=out, run_id=run_id, cell_timeout_s=args.cell_timeout, rdzv=rdzv, resume=resume)
    try:
        records = run_sweep(cells, opts, spec.device_kind)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished records are kept in {out}/records.jsonl; "
              f"finish with: harness bench --resume {out}", file=sys.stderr)
        return 130
    if node_rank == 0:
        from harness.report import write_report

        print(write_report(out))
        print(f"\nrecords: {out / 'records.jsonl'}\nsummary: {out / 'summary.md'}")
    failed = [r for r in records if r["status"] not in ("ok", "invalid")]
    return 1 if failed else 0


def _auto_calibrate(spec) -> None:
    """Measure the matmul peak once per (dtype, threads) so calibrated MFU is never missing."""
    from harness.measure import calibrate

    dtypes = sorted({p for p in spec.precisions if not (p == "tf32" and spec.device_kind != "cuda")})
    threads = sorted({calibrate.threads_per_rank(g) for g in {*spec.gpus, 1}}) if spec.device_kind == "cpu" else [0]
    for dt in dtypes:
        for th in threads:
            if calibrate.lookup(spec.device_kind, dt, th) is None:
                e = calibrate.calibrate_subprocess(spec.device_kind, dt, th)
                print(f"calibrated {spec.device_kind} {dt} threads={th}: {e:.4g} TFLOP/s matmul peak", flush=True)
    _auto_calibrate_model(spec, dtypes)


def _auto_calibrate_model(spec, dtypes: list[str]) -> None:
    """What the performance model's predictions need: workload rates per size, comm per rank count."""
    import subprocess
    import sys

    from harness.measure.calibrate_comm import calibrate_comm
    from harness.model.compute import lookup_workload
    from workloads.sizes import get_size

    from harness.measure.calibrate import threads_per_rank

    # (threads per rank, ranks computing at once) as each device count of the sweep runs them
    runs = sorted({(threads_per_rank(w), w) for w in {*spec.gpus, 1}}) if spec.device_kind == "cpu" else [(0, 1)]
    for name in spec.sizes:
        seq = spec.seq_len or get_size(name).seq_len
        for dt in dtypes:
            for th, k in runs:
                if lookup_workload(spec.device_kind, name, seq, dt, th, k) is None:
                    cmd = [sys.executable, "-m", "harness", "calibrate", "--device", spec.device_kind, "--dtype", dt,
                           "--threads", str(max(1, th)), "--no-comm", "--workloads", name, "--seq-len", str(seq),
                           "--concurrent", str(k)]
                    res = subprocess.run(cmd, timeout=3600, stdout=subprocess.PIPE, text=True)
                    if res.returncode != 0:  # the sweep goes on; its predictions say what was missing
                        print(f"workload calibration of {name} {dt} threads={th} x {k} failed (exit {res.returncode}); "
                              f"predictions fall back to the matmul peak", file=sys.stderr, flush=True)
                        continue
                    print("calibrated " + res.stdout.strip().splitlines()[-1], flush=True)
    for n in sorted({g for w in spec.gpus for g in (w, 2) if w >= 2 and g <= w}):
        e = calibrate_comm(spec.device_kind, n, COMM_MIN_BYTES, COMM_MAX_BYTES)  # reuses a covering cache entry
        print(f"comm calibration at {n} ranks ({e['measured_at']}): all_reduce peak busbw "
              f"{e['summary']['all_reduce']['peak_busbw_gbps']:.3g} GB/s, sync cost {e['sync_s'] * 1e3:.2f} ms", flush=True)


def cmd_report(args) -> int:
    from harness.report import write_report

    if not (args.dir / "records.jsonl").exists():
        raise UsageError(f"{args.dir}: no records.jsonl there; pass a run directory written by harness bench")
    print(write_report(args.dir))
    return 0


def cmd_compare(args) -> int:
    from harness.compare import run_compare

    return run_compare(str(args.base), str(args.cand), threshold=args.threshold, alpha=args.alpha,
                       normalize=args.normalize, n_bootstrap=args.bootstrap, seed=args.seed)


def _size(name: str, v: str) -> int:
    from harness.measure.calibrate_comm import parse_size

    try:
        return parse_size(v)
    except ValueError as e:
        raise UsageError(f"--{name} {e}") from None


def cmd_calibrate(args) -> int:
    from harness.measure import calibrate
    from harness.plan import default_device_kind

    device = default_device_kind() if args.device == "auto" else args.device
    threads = args.threads or (os.cpu_count() or 1)
    for dt in _csv(args.dtype):
        if dt not in calibrate.DTYPES or (dt == "tf32" and device != "cuda"):
            raise UsageError(f"--dtype {dt!r}: choose from fp32,bf16,fp16 (tf32 on GPU only)")
    comm = None if args.no_comm else _comm_args(args, device)
    workloads = _workload_args(args)
    for dt in _csv(args.dtype):
        e = calibrate.calibrate(device, dt, threads, force=args.force)
        median = e.get("median_tflops") or statistics.median(s["tflops"] for s in e["shapes"])  # older cache entries
        print(f"{device} {dt} threads={threads if device == 'cpu' else '-'}: {e['tflops']:.4g} TFLOP/s max, "
              f"{median:.4g} median over {len(e['shapes'])} shapes (best shape {e['best_shape']}) "
              f"-> {calibrate.default_cache()}")
    concurrent = _int("concurrent", args.concurrent, 1) if args.concurrent is not None else 1
    for name, seq in workloads:
        for dt in _csv(args.dtype):
            _print_workload(calibrate_workload_entry(device, name, seq, dt, threads, concurrent, args.force), threads)
    if comm is not None:
        _calibrate_comm(device, *comm, force=args.force)
    elif not args.no_comm:
        print("comm: n/a: bus bandwidth needs >= 2 ranks")
    return 0


def _workload_args(args) -> list[tuple[str, int]]:
    """(size, seq_len) pairs for the workload calibration; checked before anything runs."""
    from workloads.sizes import get_size

    out = []
    for name in _csv(args.workloads or ""):
        try:
            size = get_size(name)
        except ValueError as e:
            raise UsageError(f"--workloads: {e}") from None
        seq = _int("seq-len", args.seq_len, 1) if args.seq_len is not None else size.seq_len
        if seq > size.seq_len:
            raise UsageError(f"--seq-len {seq} exceeds {name}'s position table ({size.seq_len}); use <= {size.seq_len}")
        out.append((name, seq))
    return out


def calibrate_workload_entry(device: str, size: str, seq: int, dtype: str, threads: int, concurrent: int = 1,
                             force: bool = False) -> dict:
    from harness.model.compute import calibrate_workload

    return calibrate_workload(device, size, seq, dtype, threads if device == "cpu" else 0, concurrent, force=force)


def _print_workload(e: dict, threads: int) -> None:
    passes = ", ".join(f"{r}: {t * 1e3:.1f} ms" for r, t in zip(e["rows"], e["pass_s"]))
    print(f"workload {e['size']} seq {e['seq_len']} {e['dtype']} threads={threads} x {e['fingerprint']['concurrent']} "
          f"at once: forward+backward {passes}; "
          f"fit alpha {e['alpha_s'] * 1e3:.1f} ms + {e['beta_s_per_row'] * 1e3:.1f} ms/sequence; "
          f"AdamW step {e['optimizer_s'] * 1e3:.1f} ms for {e['params']:,} params")


def _comm_args(args, device: str) -> tuple[int, int, int] | None:
    """(ranks, min_bytes, max_bytes) for the comm calibration, None for one rank; checked before anything runs."""
    import torch

    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA GPU is visible; use --device cpu or auto")
    n = _int("gpus", args.gpus, 1) if args.gpus is not None else torch.cuda.device_count() if cuda else 2
    if cuda and n > torch.cuda.device_count():
        raise UsageError(f"--gpus {n}: only {torch.cuda.device_count()} CUDA devices are visible; "
                         f"choose --gpus <= {torch.cuda.device_count()}")
    lo = _size("comm-min-bytes", args.comm_min_bytes) if args.comm_min_bytes else COMM_MIN_BYTES
    hi = _size("comm-max-bytes", args.comm_max_bytes) if args.comm_max_bytes else COMM_MAX_BYTES
    if lo > hi:
        raise UsageError(f"--comm-min-bytes ({lo}) must be <= --comm-max-bytes ({hi}); lower the first or raise the second")
    return None if n == 1 else (n, lo, hi)


def _calibrate_comm(device: str, n: int, lo: int, hi: int, force: bool) -> None:
    from tabulate import tabulate

    from harness.measure import calibrate
    from harness.measure.calibrate_comm import COLLECTIVES, bus_factor, calibrate_comm, human_bytes

    e = calibrate_comm(device, n, lo, hi, force=force)
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
    print(f"\ncomm cache: {calibrate.default_cache()}")


def cmd_workloads(args) -> int:
    from tabulate import tabulate

    from workloads.data import MarkovData
    from workloads.sizes import SIZES

    rows = []
    for s in SIZES.values():
        floor = MarkovData(s.vocab_size, s.seq_len).entropy_floor if s.vocab_size <= 4096 else None
        rows.append([s.name, s.n_layers, s.d_model, s.n_heads, s.seq_len, s.vocab_size, f"{s.params:,}",
                     f"{s.params_nonembedding:,}", f"{s.flops_per_token() / 1e6:,.1f}",
                     f"{s.flops_per_token_megatron() / 1e6:,.1f}", f"{floor:.3f}" if floor else "-"])
    print(tabulate(rows, headers=["size", "layers", "d_model", "heads", "seq_len", "vocab", "params",
                                  "N (non-embed)", "MFLOP/token (PaLM)", "MFLOP/token (Megatron)",
                                  "entropy floor (nats)"], tablefmt="github"))
    print("\nPaLM: 6*N + 12*L*d*S; Megatron (causal-halved attention): 6*N + 6*L*d*S; "
          "N = all parameters except the token/position embedding tables (the untied LM head counts).")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="harness", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="run a sweep: one torchrun job per cell -> records, summary, plots")
    add_sweep_args(b)
    b.add_argument("--out", type=Path, help="run directory (default results/<run-id>); never overwritten")
    b.add_argument("--resume", type=Path, help="finish an interrupted run: re-run cells without an ok record")
    b.add_argument("--cell-timeout", type=float, help="seconds per cell before it is killed (default from steps)")
    b.add_argument("--node-rank", type=int, help="this machine's rank in a multi-node sweep")
    b.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (multi-node)")
    b.add_argument("--no-calibrate", action="store_true", help="skip the automatic matmul-peak calibration")
    b.set_defaults(fn=cmd_bench)
    p = sub.add_parser("plan", help="expand and validate a sweep without launching anything, or predict "
                                    "strategies on a hardware preset (--device h100 --gpus 64)")
    add_sweep_args(p)
    add_whatif_args(p)
    p.set_defaults(fn=cmd_plan)
    r = sub.add_parser("report", help="rebuild summary.md, summary.csv and plots from a run's records")
    r.add_argument("dir", type=Path)
    r.set_defaults(fn=cmd_report)
    c = sub.add_parser("compare", help="regression gate: BASE vs CAND throughput (exit 0 pass, 1 regression, 3 n/c)")
    c.add_argument("base")
    c.add_argument("cand")
    c.add_argument("--threshold", type=float, default=0.05)
    c.add_argument("--alpha", type=float, default=0.05)
    c.add_argument("--normalize", choices=("none", "calibration"), default="none",
                   help="divide throughput by the calibration workload measured in the same run")
    c.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the ratio CI")
    c.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    c.set_defaults(fn=cmd_compare)
    k = sub.add_parser("calibrate", help="measure the matmul peak (TFLOP/s) per dtype and the collective bus "
                                         "bandwidth, and cache them")
    k.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    k.add_argument("--dtype", default="fp32")
    k.add_argument("--threads", type=int, help="CPU threads for the matmul (default: all cores)")
    k.add_argument("--force", action="store_true", help="re-measure even if cached")
    k.add_argument("--gpus", help="ranks for the bus-bandwidth measurement (default: all GPUs; 2 on CPU; 1 skips it)")
    k.add_argument("--no-comm", action="store_true", help="matmul peak only")
    k.add_argument("--comm-min-bytes", help="smallest message, e.g. 4KiB (default 4KiB)")
    k.add_argument("--comm-max-bytes", help="largest message, e.g. 64MiB (default 64MiB)")
    k.add_argument("--workloads", help="sizes whose forward+backward and optimizer step to time for the "
                                       "performance model, e.g. tiny,small")
    k.add_argument("--seq-len", help="sequence length for --workloads (default: the size's)")
    k.add_argument("--concurrent", help="--workloads: copies measured at once, as many as a node's ranks (default 1)")
    k.set_defaults(fn=cmd_calibrate)
    w = sub.add_parser("workloads", help="print the workload size table")
    w.set_defaults(fn=cmd_workloads)
    from harness import trace_cmd

    trace_cmd.register(sub)
    from harness import slurm

    slurm.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"harness {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_USAGE

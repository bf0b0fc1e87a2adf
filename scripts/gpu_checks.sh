#!/usr/bin/env bash
# The GPU checks of the issues in one pass on a single GPU (run on a lent H200).
#   bash scripts/gpu_checks.sh OUTDIR            # the open issues' checks only (issues 30, 42: ~5 minutes)
#   PHASES=all bash scripts/gpu_checks.sh OUTDIR # also issues 2-5, 13 and 14, measured already (results/gpu)
# Writes each phase's run directory under OUTDIR/runs and copies what matters to OUTDIR.
set -uo pipefail
OUT="${1:?usage: gpu_checks.sh OUTDIR}"
R="$OUT/runs"
mkdir -p "$R"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HARNESS_CALIBRATION="$OUT/calibration.json"
H="python3 -m harness"
COMMON="--device cuda --gpus 1 --batch 8 --steps 8 --warmup 2 --no-calibrate --cell-timeout 240"
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv | tee "$OUT/nvidia-smi.csv"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
command -v nsys || echo "nsys: not on PATH"
# First: `make bench GPUS=1`'s default sweep through the fork server on CUDA (nothing has run on CUDA since the
# fork server, fp8, NCCL all-to-all and CP landed).
$H bench --device cuda --gpus 1 --no-calibrate --cell-timeout 240 --out "$R/default"
cp "$R/default/summary.md" "$OUT/summary-default.md"
# Issue 42: every activation checkpointing policy on llama3 1b (bf16, one GPU, 2 sequences of 8,192): the CUDA
# allocator's peak against the model's prediction (summary.md's "Predicted vs measured").
$H bench $COMMON --strategies single --arch llama3 --sizes 1b --precision bf16 --batch 2 \
    --ac none,attn,op,layer2,full --out "$R/ac-policies"
cp "$R/ac-policies/summary.md" "$OUT/summary-ac-policies.md"
# Issue 30: llama3 1b (Llama 3.2 1B's shape, untied head) bf16 on one GPU with compile and fused AdamW at
# the largest batch that fits at its 8,192-token sequence; the summary states MFU (PaLM's count) and
# `harness workloads` lists the other conventions.
$H bench --device cuda --gpus 1 --steps 8 --warmup 3 --no-calibrate --cell-timeout 300 --strategies single \
    --arch llama3 --sizes 1b --precision bf16 --compile on --optimizer adamw-fused --scaling weak --batch auto \
    --out "$R/llama3-1b"
cp "$R/llama3-1b/summary.md" "$OUT/summary-llama3-1b.md"
if [ "${PHASES:-open}" != all ]; then
    tar -C "$OUT" -czf "$OUT/runs.tar.gz" runs && rm -rf "$R"
    exit 0
fi
# Issue 13: production levers. xl bf16 with compile, fused AdamW and the largest batch that fits
# (target MFU >= 50%), small likewise (target >= 35%), and fp8 against bf16 on xl (torchao must be
# importable: carry its wheel; without it the fp8 cell is invalid with the reason).
# Each auto trial is a launched, compiled cell (~30 s with a warm inductor cache): xl searches, small
# runs at a fixed batch of 32 to stay inside the device time.
$H bench --device cuda --gpus 1 --steps 8 --warmup 3 --no-calibrate --cell-timeout 300 --strategies single \
    --sizes xl --precision bf16 --compile on --optimizer adamw-fused --scaling weak --batch auto --out "$R/levers"
cp "$R/levers/summary.md" "$OUT/summary-levers.md"
$H bench $COMMON --strategies single --sizes small --precision bf16 --compile on --optimizer adamw-fused \
    --batch 32 --warmup 3 --out "$R/levers-small"
cp "$R/levers-small/summary.md" "$OUT/summary-levers-small.md"
# Issue 45: fp8 for real on FP8 tensor cores, first of its checks: llama3 1b, bf16 against fp8 tensorwise and
# rowwise (speedup and MFU in summary.md; parity against the bf16 single device), then xl compiled.
$H bench $COMMON --strategies single --arch llama3 --sizes 1b --batch 4 --precision bf16,fp8 \
    --fp8-recipe tensorwise,rowwise --warmup 3 --out "$R/fp8-llama3-1b"
cp "$R/fp8-llama3-1b/summary.md" "$OUT/summary-fp8-llama3-1b.md"
$H bench $COMMON --strategies single --sizes xl --precision bf16,fp8 --compile on --optimizer adamw-fused \
    --warmup 3 --out "$R/fp8"
cp "$R/fp8/summary.md" "$OUT/summary-fp8.md"
# Issue 2: measured matmul peaks (calibrated MFU) for every compute dtype.
$H calibrate --device cuda --dtype fp32,tf32,bf16,fp16
# Issue 14: the MAMF-grade search's peak per dtype against the plain 8192^3 product timed in the
# same run (bf16 must reach >= 0.95 of it).
python3 - "$HARNESS_CALIBRATION" <<'PY' | tee "$OUT/matmul-peak-check.txt"
import json, sys
for e in json.load(open(sys.argv[1])).values():
    fp = e.get("fingerprint", {})
    if e.get("kind", "matmul") == "matmul" and e.get("reference_tflops"):
        ratio = e["tflops"] / e["reference_tflops"]
        print(f"{fp['dtype']}: search max {e['tflops']:.1f} TFLOP/s at {e['best_shape']}, median {e['median_tflops']:.1f}, "
              f"plain {e['reference_shape']} {e['reference_tflops']:.1f}: ratio {ratio:.3f}")
PY
# Issue 2: single cells small..xl in fp32 and bf16 (medium and large come with the precision run).
$H bench $COMMON --strategies single --sizes small,xl --precision bf16,fp32 --out "$R/sizes"
cp "$R/sizes/summary.md" "$OUT/summary-sizes.md"
# Issue 3: the strategies that run on one GPU (world size 1) on NCCL with CUDA events.
$H bench $COMMON --strategies single,ddp,fsdp --degrees dp_shard=1 --sizes small --precision bf16 --out "$R/strategies"
cp "$R/strategies/summary.md" "$OUT/summary-strategies.md"
# Issue 4: every precision mode for medium and large: AMP speedup and MFU per mode.
$H bench $COMMON --strategies single --sizes medium,large --precision fp32,tf32,bf16,fp16 --out "$R/precision"
cp "$R/precision/summary.md" "$OUT/summary-precision.md"
# Issue 5: NVTX cost on `small`: the same cell with ranges off (the sizes run had them on).
$H bench $COMMON --strategies single --sizes small --precision bf16 --nvtx off --out "$R/nvtx-off"
tar -C "$OUT" -czf "$OUT/runs.tar.gz" runs && rm -rf "$R"

#!/usr/bin/env bash
# The GPU checks of the issues in one pass on a single GPU (run on a lent H200).
#   bash scripts/gpu_checks.sh OUTDIR            # the open checks only, inside a DEADLINE (330 s)
#   PHASES=all bash scripts/gpu_checks.sh OUTDIR # also issues 2-5, 13 and 14, measured already (results/gpu)
# Writes each phase's run directory under OUTDIR/runs and copies what matters to OUTDIR.
set -uo pipefail
OUT="${1:?usage: gpu_checks.sh OUTDIR}"
R="$OUT/runs"
mkdir -p "$R"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HARNESS_CALIBRATION="$OUT/calibration.json"
H="python3 -m harness"
COMMON="--device cuda --gpus 1 --batch 8 --steps 8 --warmup 2 --no-calibrate --cell-timeout 120"
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv | tee "$OUT/nvidia-smi.csv"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
command -v nsys || echo "nsys: not on PATH"
# Each phase runs under `timeout` inside one deadline (DEADLINE seconds from here, default 330): a slow phase is cut
# and recorded, and a phase with under 20 s left is skipped and says so in OUTDIR/phases.txt.
T0=$SECONDS
DEADLINE="${DEADLINE:-330}"
phase() {  # phase NAME LIMIT_S CMD...: its output in OUTDIR/NAME.log, its exit code and seconds in phases.txt
    local name="$1" limit="$2"; shift 2
    local left=$((DEADLINE - (SECONDS - T0)))
    if [ "$left" -lt 20 ]; then echo "phase $name: skipped, ${left} s of the ${DEADLINE} s deadline left" | tee -a "$OUT/phases.txt"; return; fi
    [ "$limit" -gt "$left" ] && limit="$left"
    local s=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "phase $name: exit $? in $((SECONDS - s)) s (limit ${limit} s)" | tee -a "$OUT/phases.txt"
    tail -n 4 "$OUT/$name.log"
}
keep() { [ -f "$R/$1/summary.md" ] && cp "$R/$1/summary.md" "$OUT/summary-$1.md"; [ -f "$R/$1/records.jsonl" ] && cp "$R/$1/records.jsonl" "$OUT/records-$1.jsonl"; true; }
# torchao (fp8) is not on the lent machine's image: its wheel travels in .whl/ (pip download torchao==0.18.0).
if ls .whl/torchao-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/torchao-site .whl/torchao-*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/torchao-site"
fi
python3 -c "import torchao, torchao.float8; print('torchao', torchao.__version__)" 2>&1 | tail -1 | tee "$OUT/torchao.txt"
# First: `make bench GPUS=1`'s default sweep through the fork server on CUDA (nothing has run on CUDA since the
# fork server, fp8, NCCL all-to-all and CP landed).
phase default 120 $H bench --device cuda --gpus 1 --no-calibrate --cell-timeout 100 --out "$R/default"; keep default
# Issue 58: config models at full size, as `make bench GPUS=1 MODEL=...` runs them: Qwen3-0.6B (q/k norms per head,
# 128-wide heads over d 1024) and Llama 3.2 1B (rope_scaling, both tied heads trained untied), bf16, one GPU; the
# allocator's peak against the model's (summary.md's "Predicted vs measured").
phase model-configs 120 $H bench $COMMON --strategies single --model tests/data/hf_configs/qwen3-0.6b.json,tests/data/hf_configs/llama-3.2-1b.json \
    --precision bf16 --batch 4 --seq-len 2048 --out "$R/model-configs"; keep model-configs
# Issue 59: the op-by-op what-if's rates measured on this GPU (GEMMs at the supported models' shapes in bf16, fp8 and
# fp32, flash attention by length and head width, copy bandwidth, eager launch time, kernel floor) into
# OUTDIR/calibration.json; the rows of results/gpu are then predicted again from them, here:
#   .venv/bin/python scripts/gpu_records_vs_model.py --calibration OUTDIR/calibration.json
phase calibrate-ops 90 $H calibrate --device cuda --no-comm --ops --dtype bf16
# Issue 62: the harness's own cost on CUDA: the `single` cell of small in bf16 against a bare CUDA loop timed by the
# same CUDA events, in a fresh process and in-process, 3 rounds interleaved (bare/side ratios in OUTDIR/harness-cost).
phase harness-cost 100 python3 scripts/harness_cost.py --device cuda --rounds 3 --sides bare,here,cell \
    --out "$OUT/harness-cost"
# Issue 45: fp8 on FP8 tensor cores, llama3 1b: bf16 against fp8 tensorwise and rowwise (speedup and MFU in
# summary.md; parity against the bf16 single device; converted linears against the model's list).
phase fp8-llama3-1b 150 $H bench $COMMON --strategies single --arch llama3 --sizes 1b --batch 2 --precision bf16,fp8 \
    --fp8-recipe tensorwise,rowwise --out "$R/fp8-llama3-1b"; keep fp8-llama3-1b
# Context parallel's chunk attention on CUDA (one GPU: the attention of one rank's tail chunk at cp 4, 4,096 of 32,768
# positions, Llama 3 8B's heads): the lower-right causal bias (flash, no mask tensor) against the additive view the GPU
# path ran before, their extra peak, time and parity with causal SDPA (OUTDIR/cp-chunk-attention.md).
phase cp-chunk-attention 60 python3 scripts/cp_chunk_attention.py --device cuda --out "$OUT"
# The MoE block (grouped experts, router) on CUDA: mini, bf16, one device.
phase moe-mini 60 $H bench $COMMON --strategies single --arch moe,llama3 --sizes mini --precision bf16 --out "$R/moe-mini"; keep moe-mini
# The GPU test tier (tests/gpu), where pytest is on the image.
if python3 -c "import pytest" 2>/dev/null; then
    phase gpu-tests 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu
else
    echo "phase gpu-tests: n/a, no pytest on this machine" | tee -a "$OUT/phases.txt"
fi
# Issue 42: every activation checkpointing policy on llama3 1b (bf16, one GPU, 2 sequences of 8,192): the CUDA
# allocator's peak against the model's prediction (summary.md's "Predicted vs measured").
phase ac-policies 120 $H bench $COMMON --strategies single --arch llama3 --sizes 1b --precision bf16 --batch 2 \
    --ac none,attn,op,full --out "$R/ac-policies"; keep ac-policies
# Issue 47: `harness fit` on CUDA: one llama3 8b rank of fsdp over 8 GPUs, its measured peak against the model.
phase fit-8b 60 $H fit --device cuda --arch llama3 --sizes 8b --gpus 8 --strategies fsdp --precision bf16 --batch 1 \
    --out "$R/fit-8b"
cp "$R"/fit-8b/*.md "$OUT/" 2>/dev/null
# Issue 48: checkpoints on CUDA (NCCL's collectives for DCP's plan, the async writer on its gloo group, pinned-memory
# staging): llama3 1b, each mode, a save every 4 steps; the restore check, blocking and write seconds in summary.md.
phase checkpoints 90 $H bench $COMMON --strategies single --arch llama3 --sizes 1b --precision bf16 --batch 2 \
    --checkpoint sync,async,async-pinned --checkpoint-every 4 --out "$R/checkpoints"; keep checkpoints
# Issue 61: every claim of every record above, judged on CUDA (the counted step's matmuls in autograd's device
# threads, the fused kernel, NCCL's collectives against the model): a contradicted cell is a failure in its summary.
phase claims 20 python3 scripts/claims_table.py "$OUT"/records-*.jsonl
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

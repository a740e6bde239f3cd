#!/usr/bin/env bash
# Every GPU benchmark of BENCHMARKS.md in one call to a lent GPU machine (a machine is lent for a short time).
#
#   bash benchmarks/gpu_benchmarks.sh OUTDIR [REVISION]
#
# Runs the steps named in STEPS (default: registers attention e2e ncu graphs, whose limits add up to 540 s: one call with
# timeout_s 590 after the machine's start; also: operands tiles overhead maxbatch qjl sweep profile calls mask warps), in
# that order, each under its own time limit so that a slow one cannot starve the rest; each step's log and the updated
# BENCHMARKS.md go to OUTDIR as it ends. REVISION (KVCOMP_REVISION) is the revision the benchmarks print, where the
# machine's copy of the checkout carries a stale .git. Run it from the repository root; each step below names the
# module it runs as `python3 -m benchmarks.<module>` and that module's arguments:
#   attention: bench_decode_attention --batches 16 1 --contexts 32768 4096 131072 --encode-tokens 8192
#      --reps 30 --write (the shapes the static model's measured H100 rows use, so the two can be compared row by row;
#      the largest first, and each row is logged as it is measured with its device ms, so a step stopped by its limit
#      keeps what it measured; about 150 s for every format)
#   e2e: bench_decode_e2e --agreement --shapes 16x32768 --write (all 15 speed rows and 14 agreement rows need
#      about 200 s on an H200)
#   maxbatch: bench_decode_e2e --max-batch --max-batch-gib 16 for DynamicCache, KIVI-2, TemporalKV-2 and int8 per
#      token-head (their speed rows at 16 x 32K first): the largest batch at 32K tokens in 16 GiB, by real allocations
#      (each try prefills one sequence and copies its cache into every row); logged only (--write would replace the
#      e2e section)
#   registers: sweep_decode_kernel --configs 0 13 14 15 --shapes 16x32768 for KIVI-2 and -4 and the three
#      codebook codecs: the default launch against no register cap and caps of 128 and 168 per thread; logged only
#   operands: sweep_decode_kernel --configs 0 12 --shapes 16x32768 1x32768 for KIVI-2 and -4, TemporalKV-2,
#      int8 per token-head and fp8: the default launch (bf16 tl.dot operands for the bf16 query) against the same with
#      float32 (TF32) operands; logged only
#   mask: bench_decode_attention --batches 16 --contexts 32768 --step-mask for KIVI-2 and -4 and TemporalKV-2:
#      each call without a mask (as the attention step and the static model time it) and with the mask every decode step
#      of generate passes (one exact span per sequence, the mask itself not read); logged only
#   warps: sweep_decode_kernel --configs 0 8 16 17 18 --shapes 16x32768 16x4096 for KIVI-2 and -4, fp8 and
#      int8 per token-head: the default launch (2 warps capped at 128 registers at 16 x 32K, 4 at 16 x 4K) against 4
#      warps, against 2 uncapped and with fp16 operands (KIVI-2's keys then decoded two codes at a time; KIVI-4's are
#      by default); each row's error against the reference checks the keys' inline PTX (uniform_triton._pair); logged only
#   tiles: sweep_decode_kernel --configs 0 8 10 --shapes 16x32768 1x32768 for the formats whose tile choice
#      is not measured yet (fp8, int8, EDEN-2 with center) and two of those that default_tile widened; logged only
#   ncu: Nsight Compute on one KIVI-2 split-kernel launch at batch 16 x 32K
#   overhead: bench_decode_overhead --device cuda --write
#   qjl: bench_qjl_decode --contexts 8192 32768 --write
#   sweep: sweep_decode_kernel --write (every launch configuration; replaces its BENCHMARKS section)
#   graphs: bench_decode_attention --cuda-graphs at 1 x 4K for four formats (each layer's call captured in
#      a CUDA graph against the same call without, each rotated cache met twice before the timing); logged only
#   profile: profile_decode_step (where a decode step's host and device time go)
#   calls: profile_decode_call (where one layer's call's host time goes, with and without CUDA graphs; 20 s
#      on an H200)
# Wheels in .whl/ (omegaconf, antlr4) are installed into a temporary folder first where present. Limits in seconds
# can be changed with REGISTERS_S, WARPS_S, OPERANDS_S, ATTENTION_S, E2E_S, MAXBATCH_S, TILES_S, MASK_S, NCU_S,
# OVERHEAD_S, QJL_S, SWEEP_S, PROFILE_S, GRAPHS_S and CALLS_S (MAXBATCH_GIB: the maxbatch step's cap; OVERHEAD_REPEATS:
# the overhead step's repeats); the attention contexts with ATTENTION_CONTEXTS and the end-to-end shapes with E2E_SHAPES.
set -u
out=${1:?usage: gpu_benchmarks.sh OUTDIR [REVISION]}
export KVCOMP_REVISION=${2:-} PYTHONUNBUFFERED=1
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$out/machine.txt"

step() {  # step NAME LIMIT COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s, at $(( $(date +%s) - start ))s)"
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    echo "=== $name rc=$? after $(( $(date +%s) - start ))s"
    tail -n 40 "$out/$name.log"
    cp BENCHMARKS.md "$out/BENCHMARKS.md"
}

run() {  # run STEP: one named benchmark
    case $1 in
    attention) step attention "${ATTENTION_S:-170}" python3 -m benchmarks.bench_decode_attention --batches 16 1 \
        --contexts ${ATTENTION_CONTEXTS:-32768 4096 131072} --encode-tokens 8192 --reps 30 --write ;;
    qjl) step qjl "${QJL_S:-40}" python3 -m benchmarks.bench_qjl_decode --contexts 8192 32768 --write ;;
    graphs) step graphs "${GRAPHS_S:-30}" python3 -m benchmarks.bench_decode_attention --batches 1 --contexts 4096 \
        --codecs kivi-2 temporalkv-2 qjl eden-2 --encode-tokens 1024 --reps 30 --cuda-graphs ;;
    e2e) step e2e "${E2E_S:-200}" python3 -m benchmarks.bench_decode_e2e --agreement --shapes ${E2E_SHAPES:-16x32768} --write ;;
    maxbatch) step maxbatch "${MAXBATCH_S:-300}" python3 -m benchmarks.bench_decode_e2e --shapes 16x32768 --rows DynamicCache \
        kivi-2 temporalkv-2 int8-token-head --max-batch --max-batch-gib "${MAXBATCH_GIB:-16}" ;;
    operands) step operands "${OPERANDS_S:-80}" python3 -m benchmarks.sweep_decode_kernel --configs 0 12 \
        --shapes 16x32768 1x32768 --codecs kivi-2 kivi-4 temporalkv-2 int8-token-head fp8 ;;
    registers) step registers "${REGISTERS_S:-110}" python3 -m benchmarks.sweep_decode_kernel --configs 0 13 14 15 \
        --shapes 16x32768 --codecs kivi-2 kivi-4 temporalkv-2 channelkv-2 kvquant-2 ;;
    warps) step warps "${WARPS_S:-90}" python3 -m benchmarks.sweep_decode_kernel --configs 0 8 16 17 18 \
        --shapes 16x32768 16x4096 --codecs kivi-2 kivi-4 fp8 int8-token-head ;;
    tiles) step tiles "${TILES_S:-90}" python3 -m benchmarks.sweep_decode_kernel --configs 0 8 10 --shapes 16x32768 1x32768 \
        --codecs fp8 int8-token-head eden-2-center int4-token-head nvfp4 ;;
    mask) step mask "${MASK_S:-60}" python3 -m benchmarks.bench_decode_attention --batches 16 --contexts 32768 \
        --codecs kivi-2 kivi-4 temporalkv-2 --encode-tokens 1024 --reps 30 --step-mask ;;
    ncu) command -v ncu >/dev/null || echo "=== ncu: not on this machine, step skipped"
        command -v ncu >/dev/null && step ncu "${NCU_S:-30}" ncu --clock-control none --section SpeedOfLight \
            --section Occupancy --section LaunchStats --section WarpStateStats -k regex:_split_kernel --launch-count 1 \
            python3 -m benchmarks.bench_decode_attention --contexts 32768 --batches 16 --codecs kivi-2 --reps 1 --warmup 0 \
            --encode-tokens 256 ;;
    overhead) step overhead "${OVERHEAD_S:-45}" python3 -m benchmarks.bench_decode_overhead --device cuda --repeats "${OVERHEAD_REPEATS:-2}" --write ;;
    sweep) step sweep "${SWEEP_S:-150}" python3 -m benchmarks.sweep_decode_kernel --write ;;
    profile) step profile "${PROFILE_S:-90}" python3 -m benchmarks.profile_decode_step ;;
    calls) step calls "${CALLS_S:-60}" python3 -m benchmarks.profile_decode_call --codecs kivi-2 temporalkv-2 \
        --shapes 1x4096 16x32768 --calls 30 --cuda-graphs ;;
    *) echo "unknown step $1; steps: registers warps operands attention e2e tiles ncu overhead maxbatch qjl sweep profile graphs calls mask" ;;
    esac
}

for name in ${STEPS:-registers attention e2e ncu graphs}; do run "$name"; done
echo "=== done after $(( $(date +%s) - start ))s"

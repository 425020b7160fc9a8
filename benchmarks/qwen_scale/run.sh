#!/usr/bin/env bash
# The timing benchmarks at the size people deploy (Qwen2.5-Coder-1.5B-Instruct), one after
# another on a quiet machine, in the dtype the CPU computes natively (bfloat16 with avx512_bf16
# or amx_bf16, else float32; DTYPE=... overrides): docs/results.md, "At the size people deploy".
# Run from the repository root after `make models-qwen vllm`:
#
#     benchmarks/qwen_scale/run.sh out/qwen-scale
#
# Each benchmark writes its own JSON (with the load average and thread counts) and report; this
# script adds load.txt, the load average before and after each step. Nothing else may run beside
# it: on 2 cores a benchmark that shares the machine measures contention.
set -euo pipefail
OUT=${1:-out/qwen-scale}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
PY=.venv/bin/python
DTYPE=${DTYPE:-$($PY -c 'from kvnotes.serving.launch.launcher import cpu_dtype; print(cpu_dtype())')}
KV=.venv/bin/kvnotes
mkdir -p "$OUT"
step() {
    local name=$1; shift
    echo "$name start $(date -u +%FT%TZ) $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.txt"
    "$@" 2>&1 | tee "$OUT/$name.log" | grep -v '^\s*$' | tail -n 3
    echo "$name end $(date -u +%FT%TZ) $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.txt"
}
# compose against a perfect prefix hit of the same context, 2k and 4k tokens; then float32 at 2k
# (the dtype comparison, skipped when float32 is the native dtype)
step compose-$DTYPE $PY -m kvnotes_bench.micro.compose_ttft --model "$MODEL" --dtype "$DTYPE" \
    --lengths 2048,4096 --reps 3 --out "$OUT/compose-$DTYPE"
[ "$DTYPE" = float32 ] || step compose-fp32 $PY -m kvnotes_bench.micro.compose_ttft \
    --model "$MODEL" --dtype float32 --lengths 2048 --reps 2 --out "$OUT/compose-fp32"
# vLLM: p90 TTFT of the default (repaired) policy against prefix caching, c1 and c4, ~1.7k tokens
step skills $KV serve-bench skills --launch --model "$MODEL" --dtype "$DTYPE" --block-size 32 \
    --policies prefix,repaired --requests 8 --concurrency 1,4 --fidelity-samples 4 \
    --out "$OUT/skills"
# the erratum on vLLM's prefix cache at 2k tokens
step erratum $KV serve-bench erratum --launch --model "$MODEL" --dtype "$DTYPE" --block-size 32 \
    --context-tokens 2000 --concurrency 1 --errata append --policies in-place,erratum \
    --sessions 2 --edits 2 --requests-per-row 4 \
    --out "$OUT/erratum"

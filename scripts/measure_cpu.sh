#!/usr/bin/env bash
# The measurements behind the numbers in README.md and docs/bench/, on a quiet machine, one after another.
# Usage: bash scripts/measure_cpu.sh [OUT_DIR]   (default docs/bench). Prints the load average before each step.
set -u
out=${1:-docs/bench}
mkdir -p "$out"
step() { echo; echo "=== $* (load $(cut -d' ' -f1-3 /proc/loadavg), $(date +%H:%M:%S))"; "$@"; }
smol_hf=$(edgespec prepare smollm2-135m 2>/dev/null | awk '/target \(transformers\)/ {print $3}')
step python scripts/bench_loop.py --target "$smol_hf" --tokens 64 --repeats 5 | tee "$out/loop-overhead-smollm2.txt"
step edgespec profile --pair smollm2-135m
step edgespec profile --pair qwen2.5-coder-1.5b
step edgespec bench --pair smollm2-135m --quick --drafters int8,ngram --k 2,4,6,8,auto --out "$out"
step edgespec bench --pair smollm2-135m --quick --drafters int8,int4,ngram --k 2,4,6,8,auto --temperature 0.7 --out "$out"
step edgespec bench --pair qwen2.5-coder-1.5b --quick --drafters int4,ngram --k 2,4,6,auto --out "$out"
step edgespec bench --pair qwen2.5-coder-1.5b --quick --drafters int4,ngram --k 2,4,6,auto --temperature 0.7 --out "$out"
step edgespec bench --pair smollm2-135m --target-backend torch --quick --drafters int8,ngram --k 2,4,auto --out "$out"
step edgespec bench --pair qwen2.5-coder-1.5b --target-backend torch --dtype bfloat16 --quick --categories qa,code,rewrite \
  --drafters int4,ngram --k 3,auto --out "$out"
# Overlap (issue 7): Qwen pair, greedy, target and draft on one core each; predictions from a 1-thread profile.
step edgespec bench --pair qwen2.5-coder-1.5b --quick --threads 1 --draft-threads 1 --drafters int4 --k 2,3,4 --overlap \
  --no-anchors --out "$out/overlap"
step edgespec profile --pair qwen2.5-coder-1.5b --threads 1 --draft-threads 1 --quick --out "$out/overlap/qwen-1thread-profile.toml"
echo "=== done (load $(cut -d' ' -f1-3 /proc/loadavg), $(date +%H:%M:%S))"

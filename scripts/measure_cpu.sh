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
step edgespec profile --pair qwen2.5-coder-1.5b --target-backend torch --dtype bfloat16
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
# Auto-K against fixed K (issue 5) and full 56-prompt runs (issue 4).
step edgespec bench --pair smollm2-135m --drafters int8 --k 1,2,3,4,5,6,7,8,auto --repeats 1 --no-anchors --out "$out/autok"
step edgespec bench --pair smollm2-135m --drafters int8 --k 1,2,3,4,5,6,7,8,auto --repeats 1 --no-anchors --temperature 0.7 --out "$out/autok"
step edgespec bench --pair qwen2.5-coder-1.5b --quick --drafters int4 --k 1,2,3,4,5,6,7,8,auto --repeats 3 --no-anchors --out "$out/autok"
step edgespec bench --pair smollm2-135m --drafters int8,ngram --k 6,auto --repeats 1 --no-anchors --out "$out/full"
step edgespec bench --pair smollm2-135m --drafters int8,ngram --k 6,auto --temperature 0.7 --repeats 1 --no-anchors --out "$out/full"
step edgespec bench --pair smollm2-135m --drafters ngram --k 6,auto --repeats 1 --no-anchors --out "$out/ngram"
step edgespec bench --pair qwen2.5-coder-1.5b --drafters ngram --k 2,5,auto --repeats 1 --no-anchors --out "$out/ngram"
step edgespec bench --pair qwen2.5-coder-1.5b --drafters ngram --k 5,auto --temperature 0.7 --repeats 1 --no-anchors --out "$out/ngram"
step edgespec bench --pair qwen2.5-coder-1.5b --target-backend torch --dtype bfloat16 --drafters int4 --k 5,auto --repeats 1 \
  --out "$out/full/plain"
step edgespec bench --pair qwen2.5-coder-1.5b --target-backend torch --dtype bfloat16 --drafters int4 --k 5,auto --repeats 1 \
  --exact --out "$out/full"
step edgespec bench --pair qwen2.5-coder-1.5b --target-backend torch --dtype bfloat16 --drafters int4 --k 5,auto --repeats 1 \
  --temperature 0.7 --no-anchors --out "$out/full"
step edgespec bench --pair smollm2-135m --target-backend torch --drafters int8 --k 6,auto --repeats 1 --out "$out/full"
step edgespec bench --pair smollm2-135m --target-backend torch --drafters int8 --k 6,auto --temperature 0.7 --repeats 1 --no-anchors --out "$out/full"
step edgespec bench --pair qwen2.5-coder-1.5b --drafters int4,ngram --k 5,auto --repeats 1 --no-anchors --exact --out "$out/full"
step edgespec bench --pair qwen2.5-coder-1.5b --drafters int4,ngram --k 5,auto --repeats 1 --no-anchors --temperature 0.7 --out "$out/full"
step edgespec bench --pair qwen2.5-coder-1.5b --drafters int4 --k 1,2,3,4,5,6,7,8,auto --repeats 1 --no-anchors --out "$out/autok"
step edgespec bench --pair qwen2.5-coder-1.5b --drafters int4 --k 1,2,3,4,5,6,7,8,auto --repeats 1 --no-anchors --temperature 0.7 --out "$out/autok"
# Auto-K against a fixed-K sweep per category on a slow machine (issue 5): two prompts a category, both drafters.
step edgespec bench --pair smollm2-135m --drafters ngram,int8 --k 1,2,3,4,5,6,7,8,auto --per-category 2 --repeats 1 \
  --no-anchors --out "$out/sweep"
step edgespec bench --pair smollm2-135m --drafters ngram --k 1,2,3,4,5,6,7,8,auto --per-category 2 --repeats 1 \
  --no-anchors --temperature 0.7 --out "$out/sweep"
# The same on another machine class (Intel Xeon with AMX, 2026-12-04): both pairs, the profile's drafter(s), and the
# overlapped Qwen run again with the drafter's early prefill, its predictions from the 1-thread profile measured above.
step edgespec bench --pair smollm2-135m --drafters int8,ngram --k 1,2,3,4,5,6,7,8,auto --per-category 2 --repeats 1 \
  --no-anchors --out "$out/sweep-amx"
step edgespec bench --pair qwen2.5-coder-1.5b --drafters ngram --k 1,2,3,4,5,6,7,8,auto --per-category 2 --repeats 1 \
  --no-anchors --out "$out/sweep-amx"
step edgespec bench --pair qwen2.5-coder-1.5b --quick --threads 1 --draft-threads 1 --drafters int4 --k 1,2,3,4 --overlap \
  --no-anchors --profile "$out/overlap/qwen-1thread-profile.toml" --out "$out/overlap/steady"
for t in 0.7; do
  step edgespec bench --pair smollm2-135m --drafters int8,ngram --k 1,2,3,4,5,6,7,8,auto --per-category 2 --repeats 1 \
    --no-anchors --temperature $t --out "$out/sweep-amx"
  step edgespec bench --pair qwen2.5-coder-1.5b --drafters ngram --k 1,2,3,4,5,6,7,8,auto --per-category 2 --repeats 1 \
    --no-anchors --temperature $t --out "$out/sweep-amx"
done
echo "=== done (load $(cut -d' ' -f1-3 /proc/loadavg), $(date +%H:%M:%S))"

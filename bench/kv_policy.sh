#!/usr/bin/env bash
# KV policies (H2O, StreamingLLM) against the full cache on SmolLM2 (docs/benchmarks.md, "KV policies"):
# perplexity, KL and top-1 over 4,096-token windows of held-out text (stride 2,048: the second window scores its
# last 2,048 tokens with 2,048-4,095 tokens of context) at KV budgets of 50% and 20% of the window, then greedy
# continuation agreement and the KV bytes each sequence held (bench/kv_policy.py). Accuracy only: timings are
# not reported. Usage: bench/kv_policy.sh [ARTIFACT] [TEXT] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
ART=${1:-/tmp/h2o/smol.llmc}
TEXT=${2:-/usr/share/common-licenses/GPL-3}
OUT=${3:-bench/out/kv_policy}
TOKENS=${TOKENS:-6144}   # two windows: [0, 4096) scores all its tokens, [2048, 6144) its last 2,048
LLMC=.venv/bin/llmc
mkdir -p "$OUT"
if [ ! -e "$ART" ]; then   # the plan must take a whole 4,096-token window for the full-cache reference
    $LLMC compile smollm2-135m --target cpu -o "$ART" --max-num-batched-tokens 4096
fi
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
# the runs are independent: side by side (accuracy only; a busy machine slows them, it changes no figure)
for budget in 2048 819; do
    for policy in h2o streaming; do
        $LLMC eval "$ART" --text "$TEXT" --max-tokens "$TOKENS" --context 4096 --stride 2048 --ref "$ART" \
            --kv-policy $policy --kv-budget $budget --json -q > "$OUT/eval_${policy}_${budget}.json" &
    done
done
.venv/bin/python bench/kv_policy.py "$ART" "$TEXT" --budgets 2048,819 --output 64 > "$OUT/continuation.jsonl" &
wait
for f in "$OUT"/eval_*.json; do echo "$(basename "$f" .json): $(tr -d '\n ' < "$f")"; done
cat "$OUT/continuation.jsonl"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

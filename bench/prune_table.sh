#!/usr/bin/env bash
# Pruning table for SmolLM2-135M on the cpu target (30 layers, 9 query heads, 3 KV heads, 1536
# FFN channels): an fp32 baseline and one artifact per pruning recipe, all compiled in this run;
# then params and KV bytes per token (the artifact), the pass's own calibration cost, perplexity
# on samples/eval.txt with KL against fp32 (`llmc eval`) and batch-1 decode tokens/s (`llmc
# bench`, 1000 / TPOT p50, the best of REPEAT rounds that visit every artifact in turn, so a busy
# moment cannot favour one row), all in this run. REUSE=1 keeps artifacts that exist (re-measure
# only). Writes bench/out/prune/.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
OUT=bench/out/prune
mkdir -p "$OUT"
# row name -> compile flags; heads:0.25 rounds to one of the three KV groups per layer (unit=group,
# the default), heads-query cuts one query head from each group instead and keeps the KV cache.
declare -A FLAGS=(
  [fp32]=""
  [ffn-0.25]="--prune ffn:0.25"
  [layers-4]="--prune layers:4"
  [heads-0.25]="--prune heads:0.25"
  [heads-query-0.25]="--prune heads:0.25 --pass-option prune_heads.unit=query"
  [sparsity-2of4]="--sparsity 2:4"
)
ROWS=${ROWS:-"fp32 ffn-0.25 layers-4 heads-0.25 heads-query-0.25 sparsity-2of4"}
REPEAT=${REPEAT:-3}
for row in $ROWS; do
  [ "${REUSE:-0}" = 1 ] && [ -d "$OUT/$row.llmc" ] && continue
  # shellcheck disable=SC2086  # the flags are meant to split into words
  "$LLMC" compile smollm2-135m --quant none ${FLAGS[$row]} -o "$OUT/$row.llmc" --force -q
done
for row in $ROWS; do
  "$LLMC" eval "$OUT/$row.llmc" --text samples/eval.txt --ref "$OUT/fp32.llmc" --json > "$OUT/$row.eval.json"
done
for round in $(seq "$REPEAT"); do
  for row in $ROWS; do
    "$LLMC" bench "$OUT/$row.llmc" -n 1 --input-len 64 --output-len 64 --json > "$OUT/$row.bench.$round.json"
  done
done
python3 - "$OUT" "$REPEAT" $ROWS <<'PY'
import json, math, sys
out, repeat, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def load(path):
    return json.load(open(path))
def params(art):
    return sum(math.prod(p["type"]["shape"]) for p in load(f"{art}/graph.json")["params"])
base = params(f"{out}/fp32.llmc")
print("| pass | params | % of fp32 | KV bytes/token | calib ppl (pass) | perplexity | KL vs fp32 | decode tok/s (b=1) |")
print("|---|---|---|---|---|---|---|---|")
for row in rows:
    art = f"{out}/{row}.llmc"
    m, e = load(f"{art}/manifest.json"), load(f"{out}/{row}.eval.json")
    tpot = min(load(f"{out}/{row}.bench.{r}.json")["tpot_ms"]["p50"] for r in range(1, repeat + 1))
    lossy = [p for p in m["pipeline"] if p["name"].startswith("prune_")]
    calib = (f"{lossy[-1]['accuracy']['ppl_before']:.2f} -> {lossy[-1]['accuracy']['ppl_after']:.2f}"
             if lossy else "-")
    n = params(art)
    print(f"| {row} | {n:,} | {100 * n / base:.1f} | {m['report']['kv_bytes_per_token']:,} | {calib} "
          f"| {e['perplexity']:.3f} | {e.get('kl', 0.0):.4f} | {1000 / tpot:.1f} |")
PY

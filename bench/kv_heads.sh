#!/usr/bin/env bash
# GQA -> MQA on SmolLM2-135M (9 query heads, 3 KV heads): compiled with --kv-heads 1 grouped by
# index and by similarity, then KV bytes per token (the manifest), calibration cost (the pass's
# own report), perplexity on samples/eval.txt with KL and top-1 agreement against fp32 (`llmc
# eval`) and batch-1 decode tokens/s (`llmc bench`), all measured in this run. With 3 KV heads
# and one group, every grouping pools all three heads: the two rows must agree. Writes bench/out/kv_heads/.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
OUT=bench/out/kv_heads
mkdir -p "$OUT"
FP32=${FP32:-bench/out/smol.llmc}
GROUPINGS=${GROUPINGS:-"index similarity"}
[ -d "$FP32" ] || "$LLMC" compile smollm2-135m --quant none -o "$FP32" -q
for g in $GROUPINGS; do
  [ -d "$OUT/mqa-$g.llmc" ] || "$LLMC" compile smollm2-135m --quant none --kv-heads 1 --kv-grouping "$g" -o "$OUT/mqa-$g.llmc" -q
done
for v in fp32 $GROUPINGS; do
  art=$([ "$v" = fp32 ] && echo "$FP32" || echo "$OUT/mqa-$v.llmc")
  "$LLMC" eval "$art" --text samples/eval.txt --ref "$FP32" --json > "$OUT/$v.eval.json"
  "$LLMC" bench "$art" -n 1 --input-len 128 --output-len 64 --json > "$OUT/$v.bench.json"
done
python3 - "$OUT" "$FP32" $GROUPINGS <<'PY'
import json, sys
out, fp32, groupings = sys.argv[1], sys.argv[2], sys.argv[3:]
def manifest(path):
    return json.load(open(f"{path}/manifest.json"))
print("| model | KV heads | KV bytes/token | calib ppl (pass) | perplexity | KL vs fp32 | top-1 vs fp32 | decode tok/s (b=1) |")
print("|---|---|---|---|---|---|---|---|")
for v in ["fp32"] + groupings:
    path = fp32 if v == "fp32" else f"{out}/mqa-{v}.llmc"
    m, e, b = manifest(path), json.load(open(f"{out}/{v}.eval.json")), json.load(open(f"{out}/{v}.bench.json"))
    kv = next((p for p in m["pipeline"] if p["name"] == "convert_kv_heads"), None)
    calib = f"{kv['accuracy']['ppl_before']:.2f} -> {kv['accuracy']['ppl_after']:.2f}" if kv else "-"
    name = "fp32" if v == "fp32" else f"--kv-heads 1 --kv-grouping {v}"
    print(f"| {name} | {m['model']['num_kv_heads']} | {m['report']['kv_bytes_per_token']:,} | {calib} "
          f"| {e['perplexity']:.3f} | {e.get('kl', 0.0):.4f} | {e.get('top1_agreement', 1.0):.3f} "
          f"| {1000 / b['tpot_ms']['p50']:.1f} |")
PY

#!/usr/bin/env bash
# Quantisation table for SmolLM2-135M on the cpu target: artifact bytes, perplexity on
# samples/eval.txt, KL and top-1 agreement against fp32 (`llmc eval`), and batch-1 decode
# tokens/s from `llmc bench`, all measured in this run. Writes bench/out/quant/.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
OUT=bench/out/quant
mkdir -p "$OUT"
FP32=${FP32:-bench/out/smol.llmc}
[ -d "$FP32" ] || "$LLMC" compile smollm2-135m --quant none -o "$FP32" -q
SCHEMES=${SCHEMES:-"gguf int8 int4-rtn int4-gptq int4-awq fp8 w8a8"}
for q in $SCHEMES; do
  [ -d "$OUT/$q.llmc" ] || "$LLMC" compile smollm2-135m --quant "$q" -o "$OUT/$q.llmc" -q
done
for q in fp32 $SCHEMES; do
  art=$([ "$q" = fp32 ] && echo "$FP32" || echo "$OUT/$q.llmc")
  "$LLMC" eval "$art" --text samples/eval.txt --ref "$FP32" --json > "$OUT/$q.eval.json"
  "$LLMC" bench "$art" -n 1 --input-len 128 --output-len 64 --json > "$OUT/$q.bench.json"
done
python3 - "$OUT" "$FP32" $SCHEMES <<'PY'
import json, os, sys
out, fp32, schemes = sys.argv[1], sys.argv[2], sys.argv[3:]
def size(path):
    return os.path.getsize(os.path.join(path, "weights.safetensors"))
base = size(fp32)
print("| scheme | weights MiB | % of fp32 | perplexity | KL vs fp32 | top-1 vs fp32 | decode tok/s (b=1) |")
print("|---|---|---|---|---|---|---|")
for q in ["fp32"] + schemes:
    art = fp32 if q == "fp32" else f"{out}/{q}.llmc"
    e = json.load(open(f"{out}/{q}.eval.json"))
    b = json.load(open(f"{out}/{q}.bench.json"))
    tpot = b["tpot_ms"]["p50"]
    print(f"| {q} | {size(art) / 2**20:.1f} | {100 * size(art) / base:.1f} | {e['perplexity']:.3f} | "
          f"{e.get('kl', 0):.4f} | {e.get('top1_agreement', 1):.3f} | {1000 / tpot:.1f} |")
PY

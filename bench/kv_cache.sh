#!/usr/bin/env bash
# KV-cache formats on SmolLM2-135M (fp32 weights, cpu target): the same model compiled with
# --kv-cache none, int8, fp8 and int4, then KV bytes per token (the manifest), the pass's own
# calibration cost, perplexity on samples/eval.txt with KL and top-1 agreement against the fp32
# cache (`llmc eval --ref`), and batch-1 decode tokens/s at a 128- and a 1024-token prompt
# (`llmc bench`), all in this run, the load average printed beside the timings. Writes bench/out/kv_cache/.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
OUT=bench/out/kv_cache
FORMATS=${FORMATS:-"none int8 fp8 int4"}
mkdir -p "$OUT"
for f in $FORMATS; do
  [ -d "$OUT/$f.llmc" ] || "$LLMC" compile smollm2-135m --quant none --kv-cache "$f" -o "$OUT/$f.llmc" -q
done
for f in $FORMATS; do
  "$LLMC" eval "$OUT/$f.llmc" --text samples/eval.txt --ref "$OUT/none.llmc" --json -q > "$OUT/$f.eval.json"
done
for len in 128 1024; do
  for f in $FORMATS; do
    echo "load before $f/$len: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.txt"
    "$LLMC" bench "$OUT/$f.llmc" -n 1 --input-len "$len" --output-len 64 --json > "$OUT/$f.$len.bench.json"
  done
done
cat "$OUT/load.txt"
python3 - "$OUT" $FORMATS <<'PY'
import json, sys
out, formats = sys.argv[1], sys.argv[2:]
print("| --kv-cache | KV bytes/token | calib ppl (pass) | perplexity | KL vs fp32 cache | top-1 vs fp32 cache "
      "| decode tok/s, 128-token prompt | decode tok/s, 1024-token prompt |")
print("|---|---|---|---|---|---|---|---|")
for f in formats:
    m = json.load(open(f"{out}/{f}.llmc/manifest.json"))
    e = json.load(open(f"{out}/{f}.eval.json"))
    rate = [1000 / json.load(open(f"{out}/{f}.{n}.bench.json"))["tpot_ms"]["p50"] for n in (128, 1024)]
    kv = next((p for p in m["pipeline"] if p["name"] == "quantize_kv_cache"), None)
    calib = f"{kv['accuracy']['ppl_before']:.3f} -> {kv['accuracy']['ppl_after']:.3f}" if kv else "-"
    print(f"| {f} | {m['report']['kv_bytes_per_token']:,} | {calib} | {e['perplexity']:.3f} "
          f"| {e.get('kl', 0.0):.5f} | {e.get('top1_agreement', 1.0):.4f} | {rate[0]:.1f} | {rate[1]:.1f} |")
PY

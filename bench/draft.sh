#!/usr/bin/env bash
# Speculative-decoding drafts of SmolLM2-135M (30 layers) from its own weights: `--draft-of` the
# fp32 artifact keeping LAYERS layers (default 10 = a third, 15 = half, the default) in int4. For
# each: weight bytes, top-1 agreement and KL against the target on samples/eval.txt (`llmc eval
# --ref`; top-1 agreement is the greedy acceptance rate per drafted token), and batch-1 decode
# tokens/s (`llmc bench`), all measured in this run. Writes bench/out/draft/.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
OUT=bench/out/draft
mkdir -p "$OUT"
FP32=${FP32:-bench/out/smol.llmc}
LAYERS=${LAYERS:-"10 15"}
[ -d "$FP32" ] || "$LLMC" compile smollm2-135m --quant none -o "$FP32" -q
for k in $LAYERS; do
  [ -d "$OUT/draft-$k.llmc" ] || "$LLMC" compile smollm2-135m --draft-of "$FP32" --draft-layers "$k" -o "$OUT/draft-$k.llmc" -q
done
for v in target $LAYERS; do
  art=$([ "$v" = target ] && echo "$FP32" || echo "$OUT/draft-$v.llmc")
  "$LLMC" eval "$art" --text samples/eval.txt --ref "$FP32" --json > "$OUT/$v.eval.json"
  "$LLMC" bench "$art" -n 1 --input-len 128 --output-len 64 --json > "$OUT/$v.bench.json"
done
python3 - "$OUT" "$FP32" $LAYERS <<'PY'
import json, sys
out, fp32, layers = sys.argv[1], sys.argv[2], sys.argv[3:]
print("| model | layers | weights MiB | perplexity | KL vs target | top-1 vs target | decode tok/s (b=1) |")
print("|---|---|---|---|---|---|---|")
for v in ["target"] + layers:
    path = fp32 if v == "target" else f"{out}/draft-{v}.llmc"
    m = json.load(open(f"{path}/manifest.json"))
    e, b = json.load(open(f"{out}/{v}.eval.json")), json.load(open(f"{out}/{v}.bench.json"))
    name = "target fp32" if v == "target" else f"--draft-of --draft-layers {v}"
    print(f"| {name} | {m['model']['num_layers']} | {sum(m['report']['weight_bytes'].values()) / 2**20:.1f} "
          f"| {e['perplexity']:.2f} | {e.get('kl', 0.0):.3f} | {e.get('top1_agreement', 1.0):.3f} "
          f"| {1000 / b['tpot_ms']['p50']:.1f} |")
PY

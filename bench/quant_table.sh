#!/usr/bin/env bash
# Quantisation table for SmolLM2-135M on the cpu target, on held-out text:
#   bench/quant_table.sh TEXT
# TEXT is any long UTF-8 text that is not the calibration source (int4-gptq/int4-awq calibrate
# on text the model generates itself) and not samples/eval.txt, e.g. a licence file from the
# venv. Per scheme: weights bytes, perplexity on TEXT's first $MAX_TOKENS tokens, KL and top-1
# agreement against fp32 (`llmc eval`), batch-1 decode tokens/s (`llmc bench`, $THREADS
# threads), all measured in this run; int4 schemes at group $GROUP (or the largest size below
# it that divides K). Artifacts and JSON go to bench/out/quant/ and are reused when present
# (delete a scheme's files, or the folder, to measure it again).
set -euo pipefail
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: $0 TEXT  (a held-out UTF-8 text file)" >&2; exit 2; }
TEXT=$(realpath "$1")
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
OUT=bench/out/quant
THREADS=${THREADS:-1}
GROUP=${GROUP:-128}
MAX_TOKENS=${MAX_TOKENS:-4096}
mkdir -p "$OUT"
FP32=$OUT/fp32.llmc
[ -d "$FP32" ] || "$LLMC" compile smollm2-135m --quant none -o "$FP32" -q
SCHEMES=${SCHEMES:-"gguf int8 int4-rtn int4-gptq int4-awq fp8 w8a8"}
for q in $SCHEMES; do
  case $q in
    int4-*) flags=(--quant "$q" --group-size "$GROUP") ;;
    *) flags=(--quant "$q") ;;                # gguf: the file's own Q4_1 blocks, kept
  esac
  [ -d "$OUT/$q.llmc" ] || /usr/bin/time -f "$q compile: %e s" "$LLMC" compile smollm2-135m "${flags[@]}" -o "$OUT/$q.llmc" -q
done
for q in fp32 $SCHEMES; do
  art=$([ "$q" = fp32 ] && echo "$FP32" || echo "$OUT/$q.llmc")
  [ -s "$OUT/$q.eval.json" ] || "$LLMC" eval "$art" --text "$TEXT" --ref "$FP32" --max-tokens "$MAX_TOKENS" \
    --threads "$THREADS" --json > "$OUT/$q.eval.json"
  [ -s "$OUT/$q.bench.json" ] || "$LLMC" bench "$art" -n 1 --input-len 128 --output-len 64 --threads "$THREADS" \
    --json > "$OUT/$q.bench.json"
done
python3 - "$OUT" "$FP32" "$TEXT" $SCHEMES <<'PY'
import json, os, sys
out, fp32, text, schemes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def size(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
base = size(fp32)
tokens = json.load(open(f"{out}/fp32.eval.json")).get("tokens", "?")
print(f"Held-out text: {os.path.basename(text)} ({tokens} tokens scored)\n")
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

#!/usr/bin/env bash
# Operator fusion on the cpu target: SmolLM2-135M compiled without the fusions in FUSIONS (each
# disabled) and with the default pipeline, then batch-1 decode measured for both in this run,
# alternating ROUNDS times (best of each, to ride out a busy host). Writes bench/out/fusion/.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
OUT=bench/out/fusion
ROUNDS=${ROUNDS:-2}
FUSIONS=${FUSIONS:-"fuse_qkv fuse_gate_up fuse_swiglu fuse_rms_norm fuse_attention"}
mkdir -p "$OUT"
OFF=()
for p in $FUSIONS; do OFF+=(--disable-pass "$p"); done

"$LLMC" compile smollm2-135m --target cpu --quant none -o "$OUT/unfused.llmc" --force -q "${OFF[@]}"
"$LLMC" compile smollm2-135m --target cpu --quant none -o "$OUT/fused.llmc" --force -q
for r in $(seq 1 "$ROUNDS"); do
  for v in unfused fused; do
    "$LLMC" bench "$OUT/$v.llmc" -n 1 --input-len 64 --output-len 64 --json > "$OUT/$v.$r.json"
  done
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def best(v):
    runs = [json.load(open(f"{out}/{v}.{r}.json")) for r in range(1, rounds + 1)]
    return max(1000 / b["tpot_ms"]["p50"] for b in runs), max(b["output_tokens_per_s"] for b in runs)
(u_dec, u_all), (f_dec, f_all) = best("unfused"), best("fused")
print(f"decode tok/s (1000 / TPOT p50, best of {rounds}): unfused {u_dec:.1f}, fused {f_dec:.1f}, "
      f"ratio {f_dec / u_dec:.2f}x")
print(f"output tok/s incl. prefill: unfused {u_all:.1f}, fused {f_all:.1f}, ratio {f_all / u_all:.2f}x")
PY

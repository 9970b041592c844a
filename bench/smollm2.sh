#!/usr/bin/env bash
# The figures in the README and closing notes: SmolLM2-135M on the cpu target, each
# llmc number next to HF transformers measured in the same run. Writes bench/out/.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
OUT=bench/out
mkdir -p "$OUT"
ART=${ART:-$OUT/smol.llmc}

/usr/bin/time -f "compile wall %e s, peak RSS %M KiB" \
  "$LLMC" compile smollm2-135m --target cpu --quant none -o "$ART" --force
"$LLMC" inspect "$ART" --json > "$OUT/inspect.json"
du -sb "$ART" | awk '{printf "artifact size %.1f MiB\n", $1 / 1048576}'

# batch-1 decode: one request, 128 prompt tokens, 128 output tokens, against HF generate
"$LLMC" bench "$ART" -n 1 --input-len 128 --output-len 128 --baseline hf --json > "$OUT/bench_b1.json"
# the serving workload: 64 requests of 128 + 128 tokens, all at once, against batched HF generate
"$LLMC" bench "$ART" -n 64 --input-len 128 --output-len 128 --baseline hf --json \
  --plot "$OUT/bench_b64.png" > "$OUT/bench_b64.json"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("bench_b1", "bench_b64"):
    r = json.load(open(f"{out}/{name}.json"))
    print(f"{name}: llmc {r['output_tokens_per_s']:.1f} tok/s, HF {r['baseline']['output_tokens_per_s']:.1f} tok/s, "
          f"ratio {r['ratio']:.2f}x, TPOT p50 {r['tpot_ms']['p50']:.1f} ms, KV waste {r['kv_waste']:.2%}")
PY

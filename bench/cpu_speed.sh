#!/usr/bin/env bash
# Issue 12's table in one run: SmolLM2-135M on the cpu target, fp32 / int8 / int4-awq against HF
# eager fp32 measured in the same run: batch-1 decode (128 in, 128 out), prefill of 512 tokens,
# and 64 requests x (128 in, 128 out) against batched HF generate; tok/s, ratios vs HF and
# roofline fractions (`llmc bench`'s roofline block). Artifacts are compiled once into $DIR.
# THREADS=N sets the thread count (default: the runtime's); BANDWIDTH=GBPS skips measuring it.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
DIR=${DIR:-bench/out/cpu_speed}
mkdir -p "$DIR"
EXTRA=()
[ -n "${THREADS:-}" ] && EXTRA+=(--threads "$THREADS")
[ -n "${BANDWIDTH:-}" ] && EXTRA+=(--bandwidth "$BANDWIDTH")

for q in fp32 int8 int4-awq; do
  if [ ! -d "$DIR/$q.llmc" ]; then
    flags=(--quant "$q"); [ "$q" = fp32 ] && flags=(--quant none)
    "$LLMC" compile smollm2-135m --target cpu "${flags[@]}" -o "$DIR/$q.llmc" -q
  fi
done

bench() {  # name artifact [llmc bench flags...]
  local name=$1 art=$2; shift 2
  echo "[$(date -u +%T)] $name" >&2
  "$LLMC" bench "$art" --json "${EXTRA[@]}" "$@" > "$DIR/$name.json"
}
# interleaved: each quantised row runs right after the fp32 row of the same workload
for q in fp32 int8 int4-awq; do
  base=(); [ "$q" = fp32 ] && base=(--baseline hf)
  bench "decode_$q" "$DIR/$q.llmc" -n 1 --input-len 128 --output-len 128 "${base[@]}"
done
for q in fp32 int8 int4-awq; do
  base=(); [ "$q" = fp32 ] && base=(--baseline hf)
  bench "prefill_$q" "$DIR/$q.llmc" -n 1 --input-len 512 --output-len 1 "${base[@]}"
done
bench batch_fp32 "$DIR/fp32.llmc" -n 64 --input-len 128 --output-len 128 --baseline hf

python3 - "$DIR" <<'PY'
import json, os, sys
d = sys.argv[1]
r = {n[:-5]: json.load(open(f"{d}/{n}")) for n in os.listdir(d) if n.endswith(".json")}
roof = r["decode_fp32"]["roofline"]
bw, peak = roof["bandwidth_gbps"], roof["gemm_peak_gflops"]
fp32_bytes = roof["weight_bytes"]


def decode(q):
    x = r[f"decode_{q}"]
    hf = r["decode_fp32"]["baseline"]["output_tokens_per_s"]
    ro = x["roofline"]
    return (f"{x['output_tokens_per_s']:.1f} ({x['output_tokens_per_s'] / hf:.2f}x HF, "
            f"{ro['fraction']:.0%} of roofline {bw * 1e9 / ro['weight_bytes']:.0f} tok/s)")


def prefill(q):
    x = r[f"prefill_{q}"]
    hf = 512 / r["prefill_fp32"]["baseline"]["total_seconds"]
    tps = 512 / x["total_seconds"]
    return f"{tps:.0f} ({tps / hf:.2f}x HF, GEMM {x['roofline']['gemm_fraction']:.0%} of peak)"


hf_dec = r["decode_fp32"]["baseline"]["output_tokens_per_s"]
hf_pre = 512 / r["prefill_fp32"]["baseline"]["total_seconds"]
b = r["batch_fp32"]
qs = ["fp32", "int8", "int4-awq"]
print(f"threads {roof['threads']} · memory bandwidth {bw:.1f} GB/s · fp32 GEMM peak {peak:.0f} GFLOP/s (measured)")
print("| figure | HF eager fp32 | llmc fp32 | llmc int8 | llmc int4-awq |")
print("|---|---|---|---|---|")
print(f"| batch-1 decode tok/s (128 in, 128 out) | {hf_dec:.1f} ({hf_dec * fp32_bytes / 1e9 / bw:.0%} of roofline) | "
      + " | ".join(decode(q) for q in qs) + " |")
print(f"| prefill 512 tok/s | {hf_pre:.0f} | " + " | ".join(prefill(q) for q in qs) + " |")
print(f"| 64 x (128 in, 128 out) output tok/s | {b['baseline']['output_tokens_per_s']:.0f} | "
      f"{b['output_tokens_per_s']:.0f} ({b['ratio']:.2f}x HF, GEMM {b['roofline']['achieved_gflops']:.0f} GFLOP/s "
      f"= {b['roofline']['gemm_fraction']:.0%} of peak) | | |")
PY
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"

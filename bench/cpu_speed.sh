#!/usr/bin/env bash
# Issue 12's table in one run: SmolLM2-135M on the cpu target, fp32 / int8 / int4-awq / the GGUF's own
# Q4_1 kept (gguf) against HF
# eager fp32 measured in the same run: batch-1 decode (128 in, 128 out), prefill of 512 tokens,
# and 64 requests x (128 in, 128 out) against batched HF generate; tok/s, ratios vs HF and
# roofline fractions (`llmc bench`'s roofline block). Artifacts are compiled once into $DIR.
# THREADS=N sets the thread count (default: the runtime's); BANDWIDTH=GBPS skips measuring it.
# KERNELS="cpu ort" adds rows of artifacts compiled with --kernels ort (ONNX Runtime segments; default
# KERNELS=cpu: torch kernels only); each family's artifacts are named $q.llmc (cpu) or $q-ort.llmc.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
DIR=${DIR:-bench/out/cpu_speed}
mkdir -p "$DIR"
EXTRA=()
KERNELS=${KERNELS:-cpu}
suffix() { [ "$1" = cpu ] && echo "" || echo "-$1"; }
[ -n "${THREADS:-}" ] && EXTRA+=(--threads "$THREADS")
[ -n "${BANDWIDTH:-}" ] && EXTRA+=(--bandwidth "$BANDWIDTH")

for k in $KERNELS; do
  for q in fp32 int8 int4-awq gguf; do
    art="$DIR/$q$(suffix "$k").llmc"
    if [ ! -d "$art" ]; then
      flags=(--quant "$q"); [ "$q" = fp32 ] && flags=(--quant none)
      "$LLMC" compile smollm2-135m --target cpu "${flags[@]}" --kernels "$k" -o "$art" -q
    fi
  done
done

bench() {  # name artifact [llmc bench flags...]
  local name=$1 art=$2; shift 2
  echo "[$(date -u +%T)] $name" >&2
  "$LLMC" bench "$art" --json "${EXTRA[@]}" "$@" > "$DIR/$name.json"
}
# interleaved: each quantised row runs right after the fp32 row of the same workload
for k in $KERNELS; do
  for q in fp32 int8 int4-awq gguf; do
    base=(); [ "$q$k" = fp32cpu ] && base=(--baseline hf)
    bench "decode_$q$(suffix "$k")" "$DIR/$q$(suffix "$k").llmc" -n 1 --input-len 128 --output-len 128 "${base[@]}"
  done
done
for k in $KERNELS; do
  for q in fp32 int8 int4-awq gguf; do
    base=(); [ "$q$k" = fp32cpu ] && base=(--baseline hf)
    bench "prefill_$q$(suffix "$k")" "$DIR/$q$(suffix "$k").llmc" -n 1 --input-len 512 --output-len 1 "${base[@]}"
  done
done
bench batch_fp32 "$DIR/fp32.llmc" -n 64 --input-len 128 --output-len 128 --baseline hf

python3 - "$DIR" $KERNELS <<'PY'
import json, os, sys
d, kernels = sys.argv[1], sys.argv[2:]
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
qs = [q + ("" if k == "cpu" else f"-{k}") for k in kernels for q in ("fp32", "int8", "int4-awq", "gguf")]
print(f"threads {roof['threads']} · memory bandwidth {bw:.1f} GB/s · fp32 GEMM peak {peak:.0f} GFLOP/s (measured)")
print("| figure | HF eager fp32 | " + " | ".join(f"llmc {q}" for q in qs) + " |")
print("|---|---|" + "---|" * len(qs))
print(f"| batch-1 decode tok/s (128 in, 128 out) | {hf_dec:.1f} ({hf_dec * fp32_bytes / 1e9 / bw:.0%} of roofline) | "
      + " | ".join(decode(q) for q in qs) + " |")
print(f"| prefill 512 tok/s | {hf_pre:.0f} | " + " | ".join(prefill(q) for q in qs) + " |")
print(f"| 64 x (128 in, 128 out) output tok/s | {b['baseline']['output_tokens_per_s']:.0f} | "
      f"{b['output_tokens_per_s']:.0f} ({b['ratio']:.2f}x HF, GEMM {b['roofline']['achieved_gflops']:.0f} GFLOP/s "
      f"= {b['roofline']['gemm_fraction']:.0%} of peak) |" + " |" * (len(qs) - 1))
PY
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"

#!/usr/bin/env bash
# Issue 12's table in one run: SmolLM2-135M on the cpu target, fp32 / bf16 (the cpu-bf16 target) / int8 /
# int4-awq / the GGUF's own Q4_1 kept (gguf) / w8a8 (SmoothQuant, int8 activations per token) against HF
# eager fp32 measured in the same run: batch-1 decode (128 in, 128 out), prefill of 512 tokens,
# and 64 requests x (128 in, 128 out) against batched HF generate; tok/s, ratios vs HF and
# roofline fractions (`llmc bench`'s roofline block). Artifacts are compiled once into $DIR.
# THREADS=N sets the thread count (default: the runtime's); BANDWIDTH=GBPS skips measuring it.
# REPEAT=N (default 3) runs each decode and prefill row N times, alternating with HF where HF runs
# beside it, and reports the median run (`llmc bench --repeat`): one run on a busy host can be off 2x.
# The batched rows run once (REPEAT_BATCH=N to repeat them too: each takes minutes with HF).
# QUANTS="fp32 gguf" limits the artifacts (default all six; fp32 is always needed), BATCH=N the requests
# of the batched row (default 64), which the artifacts in BATCH_QUANTS run (default "fp32 bf16", the
# issue's row; HF's batched generate beside fp32's).
# The compile-time row times one fresh GGUF compile (`--report`: its load stage is GGUF read +
# dequantise), unless $DIR/compile.json is there already.
# KERNELS="auto cpu ort" gives rows of artifacts compiled with --kernels auto (the cpu target's default:
# families chosen by measurement, int8 activations only where the calibration text shows they cost
# the model no KL or top-1), cpu (torch kernels only) and ort (ONNX Runtime segments and decode graph
# throughout, MatMulNBits on int8 activations: the fast int4/int8 path, at the accuracy `llmc eval`
# measures); default "auto ort". Each family's artifacts are named
# $q.llmc (auto) or $q-$k.llmc. HF's baseline runs beside the first family's fp32 rows; fp32 and bf16
# have no ort row after an auto one (fp32's auto already decodes through ORT; ORT has no bf16 kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
DIR=${DIR:-bench/out/cpu_speed}
mkdir -p "$DIR"
EXTRA=()
KERNELS=${KERNELS:-auto ort}
FIRST=${KERNELS%% *}
QUANTS=${QUANTS:-fp32 bf16 int8 int4-awq gguf w8a8}
BATCH=${BATCH:-64}
BATCH_QUANTS=${BATCH_QUANTS:-fp32 bf16}
suffix() { [ "$1" = auto ] && echo "" || echo "-$1"; }
skip() {  # quant kernels: no row
  [ "$2" = ort ] && { [ "$1" = bf16 ] || { [ "$1" = fp32 ] && [ "$FIRST" != ort ]; }; }
}
[ -n "${THREADS:-}" ] && EXTRA+=(--threads "$THREADS")
[ -n "${BANDWIDTH:-}" ] && EXTRA+=(--bandwidth "$BANDWIDTH")

if [ ! -f "$DIR/compile.json" ]; then
  rm -rf "$DIR/compile-probe.llmc"
  start=$(date +%s.%N)
  "$LLMC" compile smollm2-135m --target cpu -o "$DIR/compile-probe.llmc" -q --report "$DIR/compile-report.json"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); json.dump({'wall_s': float(sys.argv[2]), \
'load_s': next(s['seconds'] for s in r['stages'] if s['name'] == 'load')}, open(sys.argv[3], 'w'))" \
    "$DIR/compile-report.json" "$(echo "$(date +%s.%N) - $start" | bc)" "$DIR/compile.json"
  rm -rf "$DIR/compile-probe.llmc"
fi
for k in $KERNELS; do
  for q in $QUANTS; do
    skip "$q" "$k" && continue
    art="$DIR/$q$(suffix "$k").llmc"
    if [ ! -d "$art" ]; then
      flags=(--target cpu --quant "$q")
      [ "$q" = fp32 ] && flags=(--target cpu --quant none)
      [ "$q" = bf16 ] && flags=(--target cpu-bf16 --quant none)
      "$LLMC" compile smollm2-135m "${flags[@]}" --kernels "$k" -o "$art" -q
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
  for q in $QUANTS; do
    skip "$q" "$k" && continue
    base=(); [ "$q$k" = "fp32$FIRST" ] && base=(--baseline hf)
    bench "decode_$q$(suffix "$k")" "$DIR/$q$(suffix "$k").llmc" -n 1 --input-len 128 --output-len 128 \
      --repeat "${REPEAT:-3}" "${base[@]}"
  done
done
for k in $KERNELS; do
  for q in $QUANTS; do
    skip "$q" "$k" && continue
    base=(); [ "$q$k" = "fp32$FIRST" ] && base=(--baseline hf)
    bench "prefill_$q$(suffix "$k")" "$DIR/$q$(suffix "$k").llmc" -n 1 --input-len 512 --output-len 1 \
      --repeat "${REPEAT:-3}" "${base[@]}"
  done
done
for k in $KERNELS; do
  for q in $QUANTS; do
    skip "$q" "$k" && continue
    [[ " $BATCH_QUANTS " == *" $q "* ]] || [ "$q$k" = "fp32$FIRST" ] || continue
    base=(); [ "$q$k" = "fp32$FIRST" ] && base=(--baseline hf)
    bench "batch_$q$(suffix "$k")" "$DIR/$q$(suffix "$k").llmc" -n "$BATCH" --input-len 128 --output-len 128 \
      --repeat "${REPEAT_BATCH:-1}" "${base[@]}"
  done
done

QUANTS="$QUANTS" BATCH="$BATCH" python3 - "$DIR" $KERNELS <<'PY'
import json, os, sys
d, kernels = sys.argv[1], sys.argv[2:]
r = {n[:-5]: json.load(open(f"{d}/{n}")) for n in os.listdir(d) if n.endswith(".json") and n != "compile-report.json"}
fp32 = "fp32" + ("" if kernels[0] == "auto" else f"-{kernels[0]}")   # the rows HF ran beside
roof = r[f"decode_{fp32}"]["roofline"]
bw, peak = roof["bandwidth_gbps"], roof["gemm_peak_gflops"]
fp32_bytes = roof["weight_bytes"]


def decode(q):
    x = r[f"decode_{q}"]
    hf = r[f"decode_{fp32}"]["baseline"]["output_tokens_per_s"]
    ro = x["roofline"]
    return (f"{x['output_tokens_per_s']:.1f} ({x['output_tokens_per_s'] / hf:.2f}x HF, "
            f"{ro['fraction']:.0%} of roofline {bw * 1e9 / ro['weight_bytes']:.0f} tok/s)")


def prefill(q):
    x = r[f"prefill_{q}"]
    hf = 512 / r[f"prefill_{fp32}"]["baseline"]["total_seconds"]
    tps = 512 / x["total_seconds"]
    return f"{tps:.0f} ({tps / hf:.2f}x HF, GEMM {x['roofline']['gemm_fraction']:.0%} of peak)"


hf_dec = r[f"decode_{fp32}"]["baseline"]["output_tokens_per_s"]
hf_pre = 512 / r[f"prefill_{fp32}"]["baseline"]["total_seconds"]
b = r[f"batch_{fp32}"]
qs = [q + ("" if k == "auto" else f"-{k}") for k in kernels for q in os.environ["QUANTS"].split()]
qs = [q for q in qs if f"decode_{q}" in r]   # bf16 has no ort row
print(f"threads {roof['threads']} · memory bandwidth {bw:.1f} GB/s · fp32 GEMM peak {peak:.0f} GFLOP/s (measured)")
print("| figure | HF eager fp32 | " + " | ".join(f"llmc {q}" for q in qs) + " |")
print("|---|---|" + "---|" * len(qs))
print(f"| batch-1 decode tok/s (128 in, 128 out) | {hf_dec:.1f} ({hf_dec * fp32_bytes / 1e9 / bw:.0%} of roofline) | "
      + " | ".join(decode(q) for q in qs) + " |")
print(f"| prefill 512 tok/s | {hf_pre:.0f} | " + " | ".join(prefill(q) for q in qs) + " |")
hf_batch = b["baseline"]["output_tokens_per_s"]
batch = {q: f"{r[f'batch_{q}']['output_tokens_per_s']:.0f} ({r[f'batch_{q}']['output_tokens_per_s'] / hf_batch:.2f}x HF)"
         for q in qs if f"batch_{q}" in r}
batch[fp32] += f", GEMM {b['roofline']['achieved_gflops']:.0f} GFLOP/s = {b['roofline']['gemm_fraction']:.0%} of peak"
print(f"| {os.environ['BATCH']} x (128 in, 128 out) output tok/s | {hf_batch:.0f} | "
      + " | ".join(batch.get(q, "") for q in qs) + " |")
c = r.get("compile")
if c:
    print(f"| compile SmolLM2 (GGUF, cpu) | | {c['wall_s']:.1f} s wall, GGUF load + dequantise {c['load_s']:.1f} s "
          "(targets < 15 s, < 5 s) |" + " |" * (len(qs) - 1))
PY
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"

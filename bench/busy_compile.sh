#!/usr/bin/env bash
# Issue 39's check of kernel choices made on a busy machine: each model is compiled twice with the
# kernel timings cleared first (`llmc cache clear`: kernel_timings and bandwidth.json of $LLMC_CACHE,
# else ~/.cache/llmc; built kernels and the sample model stay), once beside a competing load (one
# Python busy loop per CPU) and once quiet; then, quiet, every artifact's batch-1 decode is benched in
# one run (busy and quiet artifacts of a model alternate, REPEAT times each) and the decode tok/s
# ratio busy/quiet printed (target: within 10%). Each artifact's kernel choice and the load its
# timings were measured under (plan.json's kernel_choice, as `llmc inspect` shows it) are printed too.
#
#   bench/busy_compile.sh                         # SmolLM2 fp32, SmolLM2 as its GGUF (Q4_1), a 1B-shape Q4_1 GGUF
#   MODELS="tiny-q4_1" REPEAT=1 bench/busy_compile.sh   # a quick check of the script itself
#
# MODELS: smollm2-fp32 (--quant none), smollm2-gguf (the GGUF default), or SHAPE-FORMAT for
# bench/make_model.py (llama-1b-q4_1, tiny-q4_1, ...). Results in $DIR/busy_compile.json.
set -uo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
PY=${PY:-.venv/bin/python}
DIR=${DIR:-bench/out/busy_compile}
MODELS=${MODELS:-smollm2-fp32 smollm2-gguf llama-1b-q4_1}
REPEAT=${REPEAT:-3}
OUTPUT_LEN=${OUTPUT_LEN:-128}
THREADS=${THREADS:-$("$PY" -c "from llmc.runtime.threads import resolve_threads; print(resolve_threads())")}
LOADERS=${LOADERS:-$(nproc)}
mkdir -p "$DIR/models"

log() { echo "[$(date -u +%T)] $*" >&2; }

source_of() {  # model: the compile's source and flags
  case "$1" in
    smollm2-fp32) echo "smollm2-135m --quant none" ;;
    smollm2-gguf) echo "smollm2-135m" ;;
    *) local shape=${1%-*} format=${1##*-} path="$DIR/models/$1.gguf"
       if [ ! -e "$path" ]; then
         log "make_model $shape $format"
         "$PY" bench/make_model.py --shape "$shape" --format "$format" -o "$path.partial" >&2 && mv "$path.partial" "$path"
       fi
       echo "$path" ;;
  esac
}

BUSY_PIDS=()
start_load() {
  for _ in $(seq "$LOADERS"); do "$PY" -c "while True: pass" & BUSY_PIDS+=($!); done
  sleep 2   # let the loops take their cores before the compile starts
}
stop_load() {
  for pid in "${BUSY_PIDS[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  BUSY_PIDS=()
}
trap stop_load EXIT

compile() {  # model mode: a fresh artifact $DIR/MODEL.MODE.llmc, compiled with the timings cleared
  local art="$DIR/$1.$2.llmc" src
  src=$(source_of "$1") || return 1
  "$LLMC" cache clear >&2
  rm -rf "$art"
  [ "$2" = busy ] && start_load
  log "compile $1 ($2, load average $(cut -d' ' -f1 /proc/loadavg))"
  local start=$SECONDS
  # shellcheck disable=SC2086  # the source's flags split on purpose
  LLMC_NUM_THREADS=$THREADS "$LLMC" compile $src --target cpu -o "$art" -q 2> "$DIR/$1.$2.compile.err"
  local status=$?
  [ "$2" = busy ] && stop_load
  echo $((SECONDS - start)) > "$DIR/$1.$2.compile_s"
  [ $status = 0 ] || { log "compile $1 ($2) failed: $(tail -n1 "$DIR/$1.$2.compile.err")"; return 1; }
}

bench() {  # model mode round: $DIR/MODEL.MODE.ROUND.json
  log "bench $1 $2 round $3"
  "$LLMC" bench "$DIR/$1.$2.llmc" --json -n 1 --input-len 128 --output-len "$OUTPUT_LEN" --ignore-eos \
    --threads "$THREADS" > "$DIR/$1.$2.$3.json" 2> "$DIR/$1.$2.$3.err" ||
    log "bench $1 $2 failed: $(tail -n1 "$DIR/$1.$2.$3.err")"
}

for model in $MODELS; do
  for mode in busy quiet; do compile "$model" "$mode"; done
done
stop_load
for round in $(seq "$REPEAT"); do
  for model in $MODELS; do
    for mode in busy quiet; do [ -d "$DIR/$model.$mode.llmc" ] && bench "$model" "$mode" "$round"; done
  done
done

"$PY" - "$DIR" "$REPEAT" $MODELS <<'EOF'
import json, statistics, sys
from pathlib import Path

from llmc.cache import summary_line

out, repeat, models = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]


def decode_tok_s(model, mode):
    """Median over the rounds of 1000 / the median time per output token."""
    rates = []
    for r in range(1, repeat + 1):
        try:
            rates.append(1000 / json.loads((out / f"{model}.{mode}.{r}.json").read_text())["tpot_ms"]["p50"])
        except (OSError, ValueError, KeyError, ZeroDivisionError, TypeError):
            pass
    return statistics.median(rates) if rates else None


def choice(model, mode):
    try:
        meta = json.loads((out / f"{model}.{mode}.llmc" / "plan.json").read_text())["meta"]
    except (OSError, ValueError):
        return {}
    kc = meta.get("kernel_choice") or {}
    kinds = (kc.get("measured") or {}).get("kinds") or []
    return {"mode": kc.get("mode"), "ort_kinds": sum(k.get("chosen") != "cpu" for k in kinds), "kinds": len(kinds),
            "whole_plan": (kc.get("whole_plan") or {}).get("chosen"),
            "decode_graph": (meta.get("decode_graph") or {}).get("chosen"),
            "timings": kc.get("timings"), "compile_s": int((out / f"{model}.{mode}.compile_s").read_text())}


rows = {}
for model in models:
    busy, quiet = decode_tok_s(model, "busy"), decode_tok_s(model, "quiet")
    ratio = busy / quiet if busy and quiet else None
    rows[model] = {"busy_tok_s": busy, "quiet_tok_s": quiet, "ratio": ratio,
                   "choice": {mode: choice(model, mode) for mode in ("busy", "quiet")}}
    fmt = lambda v: "failed" if v is None else f"{v:.1f}"
    verdict = "" if ratio is None else ("  within 10%" if abs(ratio - 1) <= 0.10 else "  OUTSIDE 10%")
    print(f"{model:<16} decode tok/s busy-compiled {fmt(busy)}, quiet-compiled {fmt(quiet)}, ratio "
          f"{'-' if ratio is None else f'{ratio:.2f}'}{verdict}")
    for mode, c in rows[model]["choice"].items():
        if c:
            print(f"  {mode:<5} compile {c['compile_s']} s; ORT kinds {c['ort_kinds']}/{c['kinds']}, whole plan "
                  f"{c['whole_plan']}, decode graph {c['decode_graph']}; "
                  f"{summary_line(c['timings']) if c['timings'] else 'no timings recorded'}")
(out / "busy_compile.json").write_text(json.dumps(rows, indent=2, sort_keys=True))
EOF
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs; figures in $DIR/busy_compile.json"

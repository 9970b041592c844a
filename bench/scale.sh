#!/usr/bin/env bash
# Issue 38's table in one run: llmc at real model sizes, random-weight Llamas in real shapes and file
# formats (bench/make_model.py), each against llama.cpp on the same GGUF where llama-cpp-python imports.
# For each size and format: the compile's wall time, peak RSS and artifact size; the load's time and RSS
# split (a process that only loads the artifact); batch-1 decode tok/s (128 in, 128 out: the 127 steps
# after the first token, which the prefill gives) with the runtime's RSS and its split after the run
# (`llmc bench --json`'s "memory") and peak; the decode's fraction of the DRAM bandwidth (the weight
# bytes + KV bytes a step reads, over the step's time, over the bandwidth `llmc bench`'s roofline
# measured); prefill of 512 tokens in tok/s; llama.cpp's decode, prefill, RSS and load at llmc's thread
# count, in its own process (bench/llamacpp_speed.py); and how many cores other processes took meanwhile.
#   bash bench/scale.sh                      # SIZES="llama-1b llama-3b llama-8b", FORMATS="q4_1 q4_k hf-bf16"
#   SIZES=ci-300m FORMATS=q4_1 REPEAT=1 bash bench/scale.sh
# Writes the table to stdout and $DIR/scale.md, every figure to $DIR/scale.json and a plot (decode tok/s
# and runtime RSS against weight GB, llmc and llama.cpp) to $DIR/scale.png.
# DIR (default bench/out/scale) keeps the generated models ($DIR/models, made once and reused), the
# artifacts (compiled once: delete $DIR/NAME.llmc to compile again) and each step's output: NAME.STEP.json,
# its stderr (.err), /usr/bin/time's figures (.time) and the machine's busy CPU seconds around it (.busy).
# hf-bf16 rows (an HF bf16 folder compiled with --target cpu-bf16) are made for the sizes in BF16_SIZES
# (default "llama-1b llama-3b"). THREADS=N (default: the runtime's, its physical cores) for llmc and
# llama.cpp alike; BANDWIDTH=GBPS instead of `llmc bench`'s cached figure (a figure cached while the
# machine was busy understates it: fractions above 100% say so); REPEAT=N (default 3) runs each decode and
# prefill N times and reports the median run. A step that fails puts its error's line in the table and
# the run goes on. Run it on a quiet machine: a busy core slows the OpenMP decode several times over
# (the table's last column), and --kernels auto's choices are timed during the compile; 3B and 8B take
# many minutes each. A compile's wall time holds those kernel timings unless $LLMC_CACHE/kernel_timings
# has them for these shapes already (ci-300m Q4_K: 48 s the first time, 10 s after); timings cached on a
# busy machine stick to later compiles, so clear it (and bandwidth.json) before a run to report.
set -uo pipefail
cd "$(dirname "$0")/.."
LLMC=${LLMC:-.venv/bin/llmc}
PY=${PY:-.venv/bin/python}
DIR=${DIR:-bench/out/scale}
SIZES=${SIZES:-llama-1b llama-3b llama-8b}
FORMATS=${FORMATS:-q4_1 q4_k hf-bf16}
BF16_SIZES=${BF16_SIZES:-llama-1b llama-3b}
REPEAT=${REPEAT:-3}
THREADS=${THREADS:-$("$PY" -c "from llmc.runtime.threads import resolve_threads; print(resolve_threads())")}
mkdir -p "$DIR/models"
EXTRA=(--threads "$THREADS")
[ -n "${BANDWIDTH:-}" ] && EXTRA+=(--bandwidth "$BANDWIDTH")

log() { echo "[$(date -u +%T)] $*" >&2; }
error_line() {  # stderr file: the line that says what failed (llmc's one line, else a traceback's last)
  grep -m1 -iE '^(llmc: )?error|Error:' "$1" || grep -v '^\s*$' "$1" | tail -n1
}
cpu_busy() {  # the machine's busy CPU seconds since boot (time stolen by the hypervisor counts as busy)
  awk -v hz="$(getconf CLK_TCK)" '/^cpu /{print ($2 + $3 + $4 + $7 + $8 + $9) / hz}' /proc/stat
}
step() {  # name kind command...: its stdout to NAME.KIND.json, or {"error": its line} where it fails
  local base="$DIR/$1.$2" status; shift 2
  cpu_busy > "$base.busy"
  /usr/bin/time -f "%M %U %S %e" -o "$base.time" "$@" > "$base.json.tmp" 2> "$base.err"
  status=$?
  cpu_busy >> "$base.busy"
  if [ $status != 0 ]; then
    "$PY" -c 'import json,sys; print(json.dumps({"error": sys.argv[1] or "failed without a message"}))' \
      "$(error_line "$base.err")" > "$base.json"
    rm -f "$base.json.tmp"
    return 1
  fi
  mv "$base.json.tmp" "$base.json"
}
model_path() {  # size format
  [ "$2" = hf-bf16 ] && echo "$DIR/models/$1-hf-bf16" || echo "$DIR/models/$1-$2.gguf"
}

make_model() {  # size format name
  local path; path=$(model_path "$1" "$2")
  [ -e "$path" ] && return 0
  log "make_model $1 $2"
  rm -rf "$path.partial"
  step "$3" model "$PY" bench/make_model.py --shape "$1" --format "$2" -o "$path.partial" && mv "$path.partial" "$path"
}

compile() {  # size format name: the artifact, and its --report as NAME.compile.json
  local art="$DIR/$3.llmc" target=cpu
  [ -d "$art" ] && [ -f "$DIR/$3.compile.json" ] && return 0
  [ "$2" = hf-bf16 ] && target=cpu-bf16
  rm -rf "$art"
  log "compile $3 (--target $target)"
  step "$3" compile "$LLMC" compile "$(model_path "$1" "$2")" --target "$target" -o "$art" -q \
    --report "$DIR/$3.compile-report.json" && cp "$DIR/$3.compile-report.json" "$DIR/$3.compile.json"
}

# a process that only loads the artifact: import and load seconds, the RSS split after the load
LOAD_PROBE='
import json, sys, time
t = time.perf_counter()
import llmc
from llmc.runtime import memory_report
imported = time.perf_counter()
model = llmc.load(sys.argv[1], threads=int(sys.argv[2]))
loaded = time.perf_counter()
print(json.dumps({"import_s": imported - t, "load_s": loaded - imported,
                  "memory": memory_report.measure(model.engine).to_dict()}))'

bench() {  # name kind [llmc bench flags...]
  log "llmc bench $1 $2"
  step "$1" "$2" "$LLMC" bench "$DIR/$1.llmc" --json -n 1 "${EXTRA[@]}" --repeat "$REPEAT" "${@:3}"
}

llamacpp() {  # size format name
  log "llama.cpp $3"
  step "$3" llamacpp "$PY" bench/llamacpp_speed.py "$(model_path "$1" "$2")" --threads "$THREADS" --repeat "$REPEAT"
}

HAS_LLAMACPP=0
"$PY" -c "import llama_cpp" 2>/dev/null && HAS_LLAMACPP=1
[ $HAS_LLAMACPP = 1 ] || log "llama_cpp does not import: no llama.cpp columns"
ROWS=()
for size in $SIZES; do
  for fmt in $FORMATS; do
    [ "$fmt" = hf-bf16 ] && [[ " $BF16_SIZES " != *" $size "* ]] && continue
    name="$size-$fmt"
    ROWS+=("$name")
    rm -f "$DIR/$name".{model,load,decode,prefill,llamacpp}.{json,time,busy}
    make_model "$size" "$fmt" "$name" || continue
    if compile "$size" "$fmt" "$name"; then
      log "load $name"
      step "$name" load "$PY" -c "$LOAD_PROBE" "$DIR/$name.llmc" "$THREADS"
      bench "$name" decode --input-len 128 --output-len 128
      bench "$name" prefill --input-len 512 --output-len 1
    fi
    [ $HAS_LLAMACPP = 1 ] && [ "$fmt" != hf-bf16 ] && llamacpp "$size" "$fmt" "$name"
  done
done

"$PY" bench/scale_table.py --threads "$THREADS" "$DIR" "${ROWS[@]}"
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"

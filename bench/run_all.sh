#!/usr/bin/env bash
# Every benchmark that reproduces a committed table, in one call on the GPU machine. Each writes its
# table to OUT_DIR under the card's name (logprob-h100.md, gemm-h100-graph.md, ...; the log beside
# it), bench/compare_tables.py compares it row by row with docs/bench/ (the same card's table; another
# card's only as an indication), and one line per benchmark says how it went.
#
# Usage: bench/run_all.sh BUILD_DIR OUT_DIR [NAME ...]
#   NAME: norm logprob lm-head attention chain python gemm gemm-back-to-back gemm-graph (default: all of
#   these), and generate (bench_generate.py: the engine's decode step and a GRPO-like rollout against
#   transformers; opt-in, run only when named, e.g. `bench/run_all.sh BUILD OUT generate`: ~6 min alone)
# BUILD_DIR: built with the CUDA backend and the Python extension for this python3, e.g.
#   cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE=$(command -v python3) \
#         -Dpybind11_DIR=$(python3 -m pybind11 --cmakedir) && ninja -C build-gpu
# chain and python need transformers (skipped without it). GPU time: about 5 minutes for all (chain
# 2-3, the others under a minute each); the whole run keeps within RUN_ALL_BUDGET_S (default 570 s):
# a benchmark that no longer fits is skipped and named, run it alone in a second call.
# ./dev gpu-check (tools/gpu_check.sh) and bench/probes/ are not run here (tests, A/B scripts, probes).
set -uo pipefail
build=$(cd "${1:?BUILD_DIR}" && pwd) || exit 2
out=${2:?OUT_DIR}
shift 2
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
budget=${RUN_ALL_BUDGET_S:-570}
start=$SECONDS
only=" $* "

card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
slug=$(echo "$card" | grep -oE '[A-Z][0-9]{2,3}' | head -1 | tr 'A-Z' 'a-z')
slug=${slug:-gpu}
if ! ls "$build"/python/samebits/_core*.so > /dev/null 2>&1; then
  echo "no Python extension in $build/python/samebits: configure with -DPython3_EXECUTABLE=\$(command -v python3)" \
       "-Dpybind11_DIR=\$(python3 -m pybind11 --cmakedir) and build"
  exit 2
fi
torch_version=$(python3 -c "import torch; print(torch.__version__)" 2>/dev/null) || { echo "python3 has no torch"; exit 2; }
transformers_version=$(python3 -c "import transformers; print(transformers.__version__)" 2>/dev/null) || transformers_version=
plot=()
python3 -c "import matplotlib" 2>/dev/null && plot=(--plot "$out/chain-$slug.png")
echo "card: $card ($slug); torch $torch_version; transformers ${transformers_version:-not installed}; build $build" \
  | tee "$out/env-$slug.txt"

ok=0 failed=0 skipped=0
wanted() { [ "$only" = "  " ] || [[ "$only" == *" $1 "* ]]; }
skip() {  # NAME REASON
  wanted "$1" || return 0
  echo "$1: skipped, $2"
  skipped=$((skipped + 1))
}
# bench NAME COMMITTED TIMEOUT_S COMMAND...: COMMITTED is docs/bench/'s table with @ for the card's
# slug; {md} in COMMAND is the fresh table's path (OUT_DIR/ + COMMITTED's file name).
bench() {
  local name=$1 pattern=$2 limit=$3
  shift 3
  wanted "$name" || return 0
  local file md log committed t0 rc left a args=()
  file=$(basename "${pattern//@/$slug}")
  md="$out/$file" log="$out/${file%.md}.log" committed=${pattern//@/$slug}
  for a in "$@"; do args+=("${a//\{md\}/$md}"); done
  left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped, out of time (run it alone: bench/run_all.sh BUILD_DIR OUT_DIR $name)"
    skipped=$((skipped + 1))
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  t0=$SECONDS
  rm -f "$md"
  timeout "$limit" "${args[@]}" > "$log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ] || [ ! -s "$md" ]; then
    echo "$name: FAILED (exit $rc$([ "$rc" = 124 ] && echo ", timed out"), $((SECONDS - t0)) s): $(grep -v '^\s*$' "$log" | tail -1)"
    failed=$((failed + 1))
    return 0
  fi
  ok=$((ok + 1))
  local head="$name: ok in $((SECONDS - t0)) s -> $md"
  if [ -f "$committed" ]; then
    echo "$head; against $committed: $(python3 bench/compare_tables.py "$md" "$committed" --summary)"
  elif [ -f "${pattern//@/h100}" ]; then
    echo "$head; no $slug table committed; against ${pattern//@/h100} (another card, an indication only):" \
         "$(python3 bench/compare_tables.py "$md" "${pattern//@/h100}" --summary)"
  else
    echo "$head; no table committed for it"
  fi
}

bench norm docs/bench/norm-@.md 150 python3 bench/bench_norm.py "$build" --md {md}
bench logprob docs/bench/logprob-@.md 180 python3 bench/bench_logprob.py "$build" --quick --md {md}
bench lm-head docs/bench/lm-head-@.md 180 python3 bench/bench_lm_head.py "$build" --quick --md {md}
bench attention docs/bench/attention-@.md 180 python3 bench/bench_attention.py "$build" --md {md}
if [ -n "$transformers_version" ]; then
  bench chain docs/bench/chain-@.md 330 python3 bench/bench_chain.py "$build" --layers 4 --profile "${plot[@]}" --md {md}
  bench python docs/bench/python-@.md 200 env PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 bench/bench_torch.py --layers 2 --md {md}
  # opt-in: named on the command line, never part of the default run
  [[ "$only" == *" generate "* ]] && bench generate docs/bench/generate-@.md 560 python3 bench/bench_generate.py \
    "$build" --out {md}
else
  skip chain "python3 has no transformers"
  skip python "python3 has no transformers"
  [[ "$only" == *" generate "* ]] && skip generate "python3 has no transformers"
fi
if [ -x "$build/bench_gemm" ]; then
  bench gemm docs/bench/gemm-@.md 120 "$build/bench_gemm" --quick --md {md} --csv "$out/gemm-$slug.csv"
  bench gemm-back-to-back docs/bench/gemm-@-back-to-back.md 90 "$build/bench_gemm" --product forward --max-m 128 \
    --back-to-back 20 --md {md} --csv "$out/gemm-$slug-back-to-back.csv"
  bench gemm-graph docs/bench/gemm-@-graph.md 90 "$build/bench_gemm" --product forward --max-m 128 \
    --back-to-back 20 --graph --md {md} --csv "$out/gemm-$slug-graph.csv"
else
  for n in gemm gemm-back-to-back gemm-graph; do skip "$n" "no $build/bench_gemm (a build without CUDA?)"; done
fi
echo "run_all: $ok ok, $failed failed, $skipped skipped in $((SECONDS - start)) s; tables and logs in $out"
[ "$failed" -eq 0 ]

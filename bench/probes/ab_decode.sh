#!/usr/bin/env bash
# Same-card A/B of the decode step's environment switches, on the GPU machine, in one call: the
# Qwen3-8B-shaped decode step (bench_generate.py --decode --graphs-only) once per setting, each in a
# process of its own (the switches are read once a process), the plain setting first and last (its
# two runs bound the drift), then one table of milliseconds a step.
# Usage: bench/probes/ab_decode.sh BUILD_DIR OUT_DIR [SETTING ...]
#   SETTING: NAME=VALUE[,NAME=VALUE…] of SAMEBITS_* variables, e.g. SAMEBITS_NARROW_DECODE=1
#   (default: the experiments still off: the 16-row decode attention, the fused gate + up + SwiGLU GEMM).
# BATCHES (default 1,8,64) and CONTEXTS (default 1024) may be set in the environment.
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${1:?BUILD_DIR}; out=${2:?OUT_DIR}; shift 2
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(SAMEBITS_NARROW_DECODE=1 SAMEBITS_FUSED_SWIGLU=1)
mkdir -p "$out"
export PYTHONPATH=$build/python PYTHONUNBUFFERED=1
run() {  # LABEL SETTING (empty: the plain build)
  local label=$1 setting=$2 envs=()
  [ -n "$setting" ] && IFS=, read -ra envs <<< "$setting"
  env "${envs[@]}" python3 bench/bench_generate.py "$build" --decode --graphs-only --batches "${BATCHES:-1,8,64}" \
    --contexts "${CONTEXTS:-1024}" --out "$out/$label.md" > "$out/$label.log" 2>&1
  echo "$? $label ${setting:-plain}" >> "$out/runs.txt"
}
: > "$out/runs.txt"
run plain-first ""
i=0
for s in "${settings[@]}"; do i=$((i + 1)); run "setting-$i" "$s"; done
run plain-last ""
# One line a run: its setting, then "B×C ms" for each case (the table rows of bench_generate's markdown).
while read -r rc label setting; do
  printf '%-40s' "$setting"
  [ "$rc" = 0 ] || { echo " failed (rc $rc; $out/$label.log)"; continue; }
  grep -E '^\| [0-9]+ \| [0-9]+ \|' "$out/$label.md" | awk -F'|' '{ printf "  B=%s C=%s %s ms", $2+0, $3+0, $4+0 }'
  echo
done < "$out/runs.txt" | tee "$out/summary.txt"

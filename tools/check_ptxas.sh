#!/usr/bin/env bash
# Compiles every CUDA source for sm_90a with ptxas's report on and fails on what silently costs
# speed there: wgmma serialised by ptxas (C7520: a wait after every wgmma, as a run-time-count loop
# around wgmma once caused), warpgroup arrives ptxas had to inject because code touched wgmma
# accumulators in flight (C7519), and register spills. Needs nvcc; runs in CI and in ./dev gpu-check.
# The sources compile in parallel (one per core); the reports are judged one by one, in order.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
files=$(find src/cuda -name '*.cu' | sort)
export nvcc reports
printf '%s\n' $files | xargs -P "$(nproc)" -I{} sh -c \
  '"$nvcc" -Iinclude -Isrc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
     -Xptxas -v -c "{}" -o /dev/null > "$reports/$(echo {} | tr / _).log" 2>&1; echo $? > "$reports/$(echo {} | tr / _).rc"'
status=0
for f in $files; do
  log="$reports/$(echo "$f" | tr / _).log"
  if [ "$(cat "$reports/$(echo "$f" | tr / _).rc")" != 0 ]; then cat "$log"; echo "check_ptxas: $f does not compile"; exit 1; fi
  if grep -qE "C7519|C7520" "$log"; then
    echo "check_ptxas: $f: ptxas serialises wgmma or injects warpgroup arrives:"
    grep -E "C7519|C7520" "$log" | head -3; status=1
  fi
  spills=$(grep -E "[1-9][0-9]* bytes spill (stores|loads)" "$log" || true)
  if [ -n "$spills" ]; then echo "check_ptxas: $f: register spills:"; echo "$spills" | head -3; status=1; fi
done
[ $status -eq 0 ] && echo "check_ptxas: no serialised wgmma, no injected warpgroup arrives, no spills (sm_90a, $(echo $files | wc -w) sources)"
exit $status

#!/usr/bin/env bash
# Compiles every CUDA source for sm_90a with ptxas's report on and fails on what silently costs
# speed there: wgmma serialised by ptxas (C7520: a wait after every wgmma, as a run-time-count loop
# around wgmma once caused), warpgroup arrives ptxas had to inject because code touched wgmma
# accumulators in flight (C7519), and register spills. Needs nvcc; runs in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
status=0
for f in $(find src/cuda -name '*.cu' | sort); do
  report=$("$nvcc" -Iinclude -Isrc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
    -Xptxas -v -c "$f" -o /dev/null 2>&1) || { echo "$report"; echo "check_ptxas: $f does not compile"; exit 1; }
  if grep -qE "C7519|C7520" <<<"$report"; then
    echo "check_ptxas: $f: ptxas serialises wgmma or injects warpgroup arrives:"
    grep -E "C7519|C7520" <<<"$report" | head -3; status=1
  fi
  spills=$(grep -E "[1-9][0-9]* bytes spill (stores|loads)" <<<"$report" || true)
  if [ -n "$spills" ]; then echo "check_ptxas: $f: register spills:"; echo "$spills" | head -3; status=1; fi
done
[ $status -eq 0 ] && echo "check_ptxas: no serialised wgmma, no injected warpgroup arrives, no spills (sm_90a)"
exit $status

#!/usr/bin/env bash
# Nsight Compute profile of one samebits GEMM launch (and cuBLAS's, from the same bench run) on the
# GPU machine. Usage: bench/probes/profile_gemm.sh BUILD_DIR OUT_DIR SHAPE_SUBSTRING PRODUCT M
# e.g. bench/probes/profile_gemm.sh build-gpu "$OUT" "O 4096" dW 8192
set -uo pipefail
build=$1 out=$2 shape=$3 product=$4 m=$5
tag=$(echo "$shape-$product-$m" | tr -c 'A-Za-z0-9-' '_')
# The bench runs 2 warm-up calls of ours, then timed ones, then cuBLAS: profile our 3rd launch and
# the first kernel after ours (cuBLAS) by name filters.
ncu --set full --launch-skip 2 --launch-count 1 -k regex:'wgrad|gemm_sm90|gemm_generic' \
  -o "$out/ncu-$tag-ours" -f "$build/bench_gemm" --shape "$shape" --product "$product" --m "$m" \
  --md /tmp/p.md --csv /tmp/p.csv > "$out/ncu-$tag-ours.log" 2>&1
ncu --set full --launch-skip 2 --launch-count 1 -k regex:'nvjet|sm90_xmma|cutlass' \
  -o "$out/ncu-$tag-cublas" -f "$build/bench_gemm" --shape "$shape" --product "$product" --m "$m" \
  --md /tmp/p.md --csv /tmp/p.csv > "$out/ncu-$tag-cublas.log" 2>&1
for f in ours cublas; do
  echo "== $f"
  ncu --import "$out/ncu-$tag-$f.ncu-rep" --page details --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis 2>&1 \
    | grep -vE "^\s*$|----|OPT|Section:|^\s+(Metric Name|This |are |the |of |a |on |is |to |with |cycles|instructions|warp)" | head -70
done

#!/usr/bin/env bash
# Same-card A/B of GEMM changes, on the GPU machine, in one call: builds bench_gemm from this tree
# (build-gpu) and from every variant under .ab/NAME/ (this tree with include/ and src/ replaced by the
# variant's; `bench/probes/ab_gemm.sh --prepare NAME REV` fills one here from a git revision, edit it as you
# like; carry .ab and .deps), runs the CUDA GEMM tests on this tree, then every benchmark with the
# same arguments, variants first, this tree last.
# Usage: bench/probes/ab_gemm.sh --prepare NAME REV                  (here, before the call)
#        bench/probes/ab_gemm.sh OUT_DIR [bench_gemm arguments]      (on the GPU machine)
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--prepare" ]; then
  name=${2:?NAME}; rev=${3:?REV}
  rm -rf ".ab/$name" && mkdir -p ".ab/$name" && git archive "$rev" include src | tar -x -C ".ab/$name"
  echo "$rev ($(git rev-parse --short "$rev"))" > ".ab/$name/REV" && exit 0
fi
out=${1:?OUT_DIR}; shift
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/card.txt"
build() {  # SOURCE_DIR BUILD_DIR TARGETS...
  local dir=$1 b=$2; shift 2
  cmake -S "$dir" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release > "$b.cmake.log" 2>&1 || { tail -30 "$b.cmake.log"; return 1; }
  ninja -C "$b" "$@" > "$b.build.log" 2>&1 || { grep -E "error" "$b.build.log" | head -30; return 1; }
}
variants=()
for v in .ab/*/; do
  v=$(basename "$v"); variants+=("$v")
  src=/tmp/ab-src-$v
  rm -rf "$src" && mkdir -p "$src" && cp -r CMakeLists.txt cmake bench python tests tools docs .deps "$src"/ && cp -r ".ab/$v/include" ".ab/$v/src" "$src"/
  build "$src" "/tmp/ab-build-$v" bench_gemm &
done
build . build-gpu bench_gemm samebits_tests || exit 1
wait
echo "== CUDA GEMM tests (this tree)"
timeout 300 build-gpu/tests/samebits_tests --gtest_filter='CudaLinear*' > "$out/tests.log" 2>&1 || { echo "tests failed or hung (exit $?)"; tail -5 "$out/tests.log"; exit 1; }
grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which is|^HASH" "$out/tests.log" | head -20
for v in "${variants[@]}"; do
  echo "== variant $v: $(cat ".ab/$v/REV")"
  "/tmp/ab-build-$v/bench_gemm" "$@" --csv "$out/$v.csv" > /tmp/ab-$v.log 2>&1 || tail -5 /tmp/ab-$v.log
done
echo "== this tree"
build-gpu/bench_gemm "$@" --csv "$out/tree.csv" > /tmp/ab-tree.log 2>&1 || tail -5 /tmp/ab-tree.log
python3 bench/probes/ab_table.py $(ls "$out"/*.csv | grep -v tree.csv) "$out/tree.csv"
# SASS of this tree's kernels, for reading here (local memory, warpgroup waits, atomics).
cuobjdump --dump-sass build-gpu/CMakeFiles/samebits.dir/src/cuda/linear/gemm_sm90_wgrad.cu.o > "$out/sass_wgrad.txt" 2>&1 || true

#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, the CUDA status matrix, SASS atomics check,
# compute-sanitizer, and the GEMM benchmark. Needs .deps (tools/device-deps.sh) carried along.
# Usage: bench/gpu_check.sh OUT_DIR [--full]
set -uo pipefail
out=${1:?OUT_DIR}
full=${2:-}
export PATH=/usr/local/cuda/bin:$PATH
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/card.txt"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 || { tail -30 /tmp/cmake.log; exit 1; }
ninja -C build-gpu > /tmp/build.log 2>&1 || { grep -E "error" /tmp/build.log | head -30; exit 1; }
echo "== GPU tests"
OMP_WAIT_POLICY=passive timeout 600 build-gpu/tests/samebits_tests --gtest_filter='CudaGemm*:Validation*:Harness*' > "$out/tests.log" 2>&1
grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which is|actual|^HASH|^ACCURACY" "$out/tests.log" | head -30
echo "== status matrix (cuda)"
build-gpu/samebits verify --backend cuda --no-chain -q --status-dir "$out" | grep -E "^linear|FAIL|ERROR linear (bf|fp16)" | head -12
rm -f "$out/cuda.json"
echo "== SASS: value-adding atomics in libsamebits.so"
cuobjdump --dump-sass build-gpu/libsamebits.so > /tmp/sass.txt 2>&1
# Opcodes only (after the address and an optional predicate): SYNCS.ARRIVE.TRANS64.RED is an mbarrier
# arrival on a cluster peer (the dW kernel's stage release), not an atomic on data.
op='^\s+/\*[0-9a-f]+\*/\s+(@!?U?P[0-9T]+\s+)?'
echo "kernels: $(grep -c 'Function :' /tmp/sass.txt), ATOM/RED instructions: $(grep -cE "$op(ATOM|ATOMS|ATOMG|RED)[.[:space:]]" /tmp/sass.txt)" \
  "(mbarrier peer arrivals, not data atomics: $(grep -cE "$op""SYNCS\.ARRIVE\.[A-Z0-9.]*RED" /tmp/sass.txt))"
echo "HGMMA: $(grep -c HGMMA /tmp/sass.txt), UTMALDG: $(grep -c UTMALDG /tmp/sass.txt), HMMA: $(grep -c HMMA /tmp/sass.txt)"
echo "== compute-sanitizer"
for tool in memcheck racecheck; do
  timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/samebits_tests \
    --gtest_filter='CudaGemm.HundredRepeatsAreIdentical:CudaGemm.WeightGradient*' > "$out/sanitizer_$tool.log" 2>&1
  echo "$tool exit $? : $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer_$tool.log" | tail -1)"
done
echo "== GEMM benchmark"
if [ "$full" = "--full" ]; then
  build-gpu/bench_gemm --md "$out/gemm.md" --csv "$out/gemm.csv" | tail -100
else
  build-gpu/bench_gemm --quick --md "$out/gemm.md" --csv "$out/gemm.csv"
fi

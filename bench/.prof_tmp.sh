export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > /tmp/c.log 2>&1; ninja -C build-gpu bench_gemm > /tmp/b.log 2>&1 || { grep error /tmp/b.log | head; exit 1; }
mkdir -p /tmp/prof
for s in "LM head (Qwen3)" "gate+up (Qwen3)"; do
  echo "######## $s"
  ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --metrics gpc__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum --launch-skip 2 --launch-count 1 -k regex:'wgrad' build-gpu/bench_gemm --shape "$s" --product dW --m 8192 --csv /tmp/p.csv 2>&1 | grep -E "Duration|Throughput|per_second|hmma|hit_rate|dram__bytes|Hit Rate|SM Frequency|DRAM Frequency" | head -20
  ncu --section SpeedOfLight --metrics gpc__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum --launch-skip 2 --launch-count 1 -k regex:'nvjet|sm90_xmma|cutlass' build-gpu/bench_gemm --shape "$s" --product dW --m 8192 --csv /tmp/p.csv 2>&1 | grep -E "Duration|Throughput|per_second|hmma|hit_rate|dram__bytes|SM Frequency|nvjet|xmma" | head -20
done

export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > /tmp/c.log 2>&1; ninja -C build-gpu bench_gemm > /tmp/b.log 2>&1 || { grep error /tmp/b.log | head; exit 1; }
for s in "LM head (Llama)" "gate+up (Qwen3)"; do
  for k in 'gemm_sm90' 'nvjet|sm90_xmma|cutlass'; do
  echo "######## $s $k"
  ncu --section SpeedOfLight --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active --launch-skip 2 --launch-count 1 -k regex:"$k" build-gpu/bench_gemm --shape "$s" --product forward --m 8192 --csv /tmp/p.csv 2>&1 | grep -E "Duration|dram__bytes|hit_rate|hmma|SM Frequency|  [a-z_]*nvjet|  [a-z_]*gemm" | head -12
  done
done
echo "######## interleaved bench, forward"
build-gpu/bench_gemm --product forward --csv $1/fwd.csv | grep -E "M=(1|16|64|128|1024|2048|4096|8192) "

// How fast a decode step's KV cache can be read on this card, the way the decode attention reads it
// and in other ways, with no arithmetic: the ceiling of the attention kernel's memory stream.
//
// Why this program. At B = 64, C = 1k (Qwen3-8B's 8 KV heads of 128) the decode attention reads its
// KV at ~77% of the copy bandwidth (docs/attention.md) although its per-block arithmetic is a third
// of the block's transfer time. A CTA reads one KV head: a 128-key block is 64-row TMA boxes of
// 128 bytes a row, rows 2 KB apart in the cache ([rows, 8 heads, 128]); the other heads' CTAs read
// the rest of each row at other times. This probe streams the same bytes through the same kind of
// ring (3 stages of 64 KB, one CTA an SM walking items, a consumer that only releases stages) in
// three ways and prints the bandwidth of each beside a device-to-device copy's:
//   head:       an item a (sequence, head), a stage 128 keys of it: 4 boxes {64 cols, 1 head, 64 rows}
//               of K and 4 of V (today's attention);
//   head-tall:  the same with boxes of 128 rows (half the loads);
//   all-heads:  an item a sequence, a stage 16 keys of every head: 2 boxes {64 cols, 8 heads, 16 rows}
//               of K and 2 of V (whole 2 KB rows, the bytes contiguous).
// If all-heads is much faster than head, the cache layout (or which heads a CTA takes) is worth
// changing; if not, the gap is in the kernel. Usage: build/bench_kv_read_pattern [sequences] [context]
// (a probe: bench/probes/kv_read_pattern.cu, target bench_kv_read_pattern).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/common/sm90/primitives.cuh"

namespace {

using namespace samebits::cuda::sm90;

constexpr int HEADS = 8, D = 128, STAGES = 3, STAGE_BYTES = 64 * 1024;

#define CHECK(x)                                                                    \
  do {                                                                              \
    const cudaError_t e_ = (x);                                                     \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

// [rows, HEADS, D] bf16 as boxes {64, box_heads, box_rows}, 128-byte swizzle (the attention's maps).
CUtensorMap map_of(const __nv_bfloat16* p, int64_t rows, int box_heads, int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap m;
  const cuuint64_t dims[3] = {D, HEADS, cuuint64_t(rows)};
  const cuuint64_t strides[2] = {D * 2, HEADS * D * 2};
  const cuuint32_t box[3] = {64, cuuint32_t(box_heads), cuuint32_t(box_rows)};
  const cuuint32_t elem[3] = {1, 1, 1};
  if (encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<__nv_bfloat16*>(p), dims, strides, box, elem,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed\n");
    std::exit(1);
  }
  return m;
}

enum Mode { HEAD = 0, HEAD_TALL = 1, ALL_HEADS = 2 };

// One CTA an SM walks items blockIdx.x, + gridDim.x, …; warp 0's lane 0 fills the ring, warp 1's
// lane 0 waits for each stage and hands it back (touching one word, so the wait is not elided).
template <int MODE>
__global__ void __launch_bounds__(64, 1) read_kv(const __grid_constant__ CUtensorMap k,
                                                 const __grid_constant__ CUtensorMap v, int seqs, int ctx,
                                                 unsigned* sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + STAGES * STAGE_BYTES);
  uint64_t* empty = full + STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int items = MODE == ALL_HEADS ? seqs : seqs * HEADS;
  const int rows_per_stage = MODE == ALL_HEADS ? 16 : 128, stages_per_item = ctx / rows_per_stage;
  if (threadIdx.x == 0) {  // producer
    int n = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x)
      for (int j = 0; j < stages_per_item; ++j, ++n) {
        const int s = n % STAGES;
        if (n >= STAGES) mbar_wait(&empty[s], ((n / STAGES) - 1) & 1);
        mbar_expect_tx(&full[s], STAGE_BYTES);
        uint8_t* dst = ring + s * STAGE_BYTES;
        const int seq = MODE == ALL_HEADS ? item : item / HEADS, head = MODE == ALL_HEADS ? 0 : item % HEADS;
        const int row0 = seq * ctx + j * rows_per_stage;
        for (int t = 0; t < 2; ++t) {  // K, V
          const CUtensorMap* m = t == 0 ? &k : &v;
          uint8_t* half = dst + t * (STAGE_BYTES / 2);
          if (MODE == HEAD) {
            for (int r = 0; r < 2; ++r)
              for (int c = 0; c < 2; ++c) tma_load_3d(half + (r * 2 + c) * 8192, m, c * 64, head, row0 + r * 64, &full[s]);
          } else if (MODE == HEAD_TALL) {
            for (int c = 0; c < 2; ++c) tma_load_3d(half + c * 16384, m, c * 64, head, row0, &full[s]);
          } else {
            for (int c = 0; c < 2; ++c) tma_load_3d(half + c * 16384, m, c * 64, 0, row0, &full[s]);
          }
        }
      }
  } else if (threadIdx.x == 32) {  // consumer
    unsigned acc = 0;
    int n = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x)
      for (int j = 0; j < stages_per_item; ++j, ++n) {
        const int s = n % STAGES;
        mbar_wait(&full[s], (n / STAGES) & 1);
        acc += *reinterpret_cast<const unsigned*>(ring + s * STAGE_BYTES + (n % 64) * 4);
        mbar_arrive(&empty[s]);
      }
    sink[blockIdx.x] = acc;
  }
#endif
}

// The median of 10 timed runs of `launch` (after two warm-up runs), CUDA events around each.
template <class F>
float median_ms(F&& launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int rep = 0; rep < 12; ++rep) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (rep >= 2) ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <int MODE>
float time_mode(const CUtensorMap& k, const CUtensorMap& v, int seqs, int ctx, int sms, unsigned* sink) {
  const int smem = STAGES * STAGE_BYTES + 2 * STAGES * 8 + 1024;
  CHECK(cudaFuncSetAttribute(read_kv<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int items = MODE == ALL_HEADS ? seqs : seqs * HEADS;
  const int grid = std::min(items, sms);
  return median_ms([&] { read_kv<MODE><<<grid, 64, smem>>>(k, v, seqs, ctx, sink); });
}

}  // namespace

int main(int argc, char** argv) {
  const int seqs = argc > 1 ? std::atoi(argv[1]) : 64, ctx = argc > 2 ? std::atoi(argv[2]) : 1024;
  if (seqs < 1 || ctx < 128 || ctx % 128) {
    std::fprintf(stderr, "usage: bench_kv_read_pattern [sequences >= 1] [context, a multiple of 128]\n");
    return 2;
  }
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  const size_t rows = size_t(seqs) * ctx, bytes = rows * HEADS * D * 2;  // one of K, V
  __nv_bfloat16 *k = nullptr, *v = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&k, bytes));
  CHECK(cudaMalloc(&v, bytes));
  CHECK(cudaMalloc(&sink, sizeof(unsigned) * 1024));
  CHECK(cudaMemset(k, 1, bytes));
  CHECK(cudaMemset(v, 2, bytes));
  const double total = 2.0 * double(bytes);
  std::printf("%s, %d SMs: %d sequences x %d keys x %d heads x %d (bf16), K + V = %.1f MB\n", prop.name, sms, seqs, ctx,
              HEADS, D, total / 1e6);
  // The reference: a device-to-device copy of the same bytes (read + written, as bench_generate counts).
  const float copy_ms = median_ms([&] { CHECK(cudaMemcpyAsync(v, k, bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_bw = 2.0 * double(bytes) / (copy_ms * 1e-3) / 1e12;
  std::printf("copy (read + written): %.3f ms, %.2f TB/s\n", copy_ms, copy_bw);
  const struct {
    const char* name;
    float ms;
  } runs[] = {
      {"head      (4 boxes {64,1,64} a tensor a stage)", time_mode<HEAD>(map_of(k, rows, 1, 64), map_of(v, rows, 1, 64), seqs, ctx, sms, sink)},
      {"head-tall (2 boxes {64,1,128})", time_mode<HEAD_TALL>(map_of(k, rows, 1, 128), map_of(v, rows, 1, 128), seqs, ctx, sms, sink)},
      {"all-heads (2 boxes {64,8,16})", time_mode<ALL_HEADS>(map_of(k, rows, 8, 16), map_of(v, rows, 8, 16), seqs, ctx, sms, sink)},
  };
  for (const auto& r : runs) {
    const double bw = total / (r.ms * 1e-3) / 1e12;
    std::printf("%-48s %.3f ms, %.2f TB/s read, %.0f%% of the copy's\n", r.name, r.ms, bw, 100.0 * bw / copy_bw);
  }
  return 0;
}

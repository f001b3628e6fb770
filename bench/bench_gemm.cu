// samebits GEMM against cuBLAS, same process, same card: forward (y = x·wᵀ), dX (dy·w) and dW
// (dW += dyᵀ·x into fp32) on the Qwen3-8B and Llama-3-8B projection shapes across M.
// CUDA-event timing, warm-up, median of the repetitions, inputs rotated past L2, random data.
// Writes a markdown table (and a CSV for the plot) naming the card.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "samebits/ops.hpp"

using namespace samebits;

#define CK(x)                                                                      \
  do {                                                                             \
    auto e_ = (x);                                                                 \
    if (e_ != 0) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #x, int(e_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

namespace {

// parts: the layer's linears of one x as separate weights (Q, K, V; gate, up), as transformers holds
// them: samebits runs them as one linear_group_forward, cuBLAS as one call a part (F.linear each).
struct Shape {
  const char* name;
  int64_t N, K;
  std::vector<int64_t> parts = {};
};

__global__ void fill_random(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = (uint64_t(i) + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z ^= z >> 31;
    p[i] = __float2bfloat16(float(int64_t(z % 2001) - 1000) / 1000.0f);
  }
}

// Reads n 16-byte words with every SM busy (grid-stride, four loads in flight per thread) and folds
// them into a word that is stored only if it matches a constant, so no load can be dropped: the
// weight-streaming ceiling of one call of this size on this card, launch and ramp included.
__global__ void stream_read(const uint4* __restrict__ p, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = p[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;
}

__global__ void empty_kernel() {}

// Median milliseconds of ours(rep) and theirs(rep), timed alternately (ours, theirs, ours, ...) after
// two warm-up calls of each, so that a drift of the card's clock under sustained load (power, heat)
// falls on both alike instead of on whichever runs second.
struct PairMs {
  double ours, theirs;
};
// With back_to_back > 1 a sample is that many calls launched in a row, timed together: the time of
// a call once the launches queue ahead of it (decode steps), where the host's launch rate, not its
// latency, is the floor. With graph, those calls are captured into a CUDA graph first and the graph's
// launch is timed: the GPU's time alone.
int back_to_back = 1;
bool graph = false;
cudaStream_t bench_stream = nullptr;
template <class A, class B>
PairMs time_pair(A&& ours, B&& theirs, int max_reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) {
    ours(i);
    theirs(i);
  }
  CK(cudaDeviceSynchronize());
  std::vector<float> t[2];
  float total = 0;
  auto once = [&](auto& fn, int i, std::vector<float>& out) {
    auto calls = [&] {
      for (int j = 0; j < back_to_back; ++j) fn(i * back_to_back + j);
    };
    cudaGraphExec_t exec = nullptr;
    if (graph) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(bench_stream, cudaStreamCaptureModeThreadLocal));
      calls();
      CK(cudaStreamEndCapture(bench_stream, &g));
      CK(cudaGraphInstantiate(&exec, g, 0));
      CK(cudaGraphDestroy(g));
      CK(cudaGraphUpload(exec, bench_stream));
      CK(cudaStreamSynchronize(bench_stream));
    }
    CK(cudaEventRecord(a, bench_stream));
    if (graph) CK(cudaGraphLaunch(exec, bench_stream));
    else calls();
    CK(cudaEventRecord(b, bench_stream));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    ms /= float(back_to_back);
    if (exec) CK(cudaGraphExecDestroy(exec));
    out.push_back(ms);
    total += ms;
  };
  for (int i = 0; i < max_reps && (i < 3 || total < 400.0f); ++i) {
    once(ours, i, t[0]);
    once(theirs, i, t[1]);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  for (auto& v : t) std::sort(v.begin(), v.end());
  return {t[0][t[0].size() / 2], t[1][t[1].size() / 2]};
}

TensorView dev(void* p, DType d, int64_t r, int64_t c) { return TensorView::of(p, d, {r, c}, Device::cuda); }

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string md = "gemm.md", csv = "gemm.csv";
  std::string shape_filter, product_filter;  // substrings; empty: all
  int64_t m_filter = 0;                      // one M; 0: all
  int64_t min_m = 0;                         // only M >= min_m
  int64_t max_m_filter = 0;                  // only M <= this; 0: no limit
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--md") && i + 1 < argc) md = argv[++i];
    else if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) csv = argv[++i];
    else if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) shape_filter = argv[++i];
    else if (!std::strcmp(argv[i], "--product") && i + 1 < argc) product_filter = argv[++i];
    else if (!std::strcmp(argv[i], "--m") && i + 1 < argc) m_filter = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--min-m") && i + 1 < argc) min_m = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-m") && i + 1 < argc) max_m_filter = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--back-to-back") && i + 1 < argc) back_to_back = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--graph")) graph = true;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  const std::vector<Shape> shapes = {
      {"QKV 4096->6144", 6144, 4096},          {"O 4096->4096", 4096, 4096},
      {"gate+up (Qwen3) 4096->24576", 24576, 4096}, {"gate+up (Llama) 4096->28672", 28672, 4096},
      {"down (Qwen3) 12288->4096", 4096, 12288},    {"down (Llama) 14336->4096", 4096, 14336},
      {"LM head (Qwen3) 4096->151936", 151936, 4096}, {"LM head (Llama) 4096->128256", 128256, 4096},
      {"Q,K,V parts 4096->4096+1024+1024", 6144, 4096, {4096, 1024, 1024}},
      {"gate,up parts (Qwen3) 4096->12288+12288", 24576, 4096, {12288, 12288}}};
  std::vector<int64_t> ms = {1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
  std::vector<Shape> run_shapes = shapes;
  if (quick) {
    ms = {1, 128, 1024, 4096};
    run_shapes = {shapes[1], shapes[6]};
  }
  if (!shape_filter.empty())
    run_shapes.erase(std::remove_if(run_shapes.begin(), run_shapes.end(),
                                    [&](const Shape& s) { return std::string(s.name).find(shape_filter) == std::string::npos; }),
                     run_shapes.end());
  if (m_filter > 0) ms = {m_filter};
  ms.erase(std::remove_if(ms.begin(), ms.end(),
                          [&](int64_t m) { return m < min_m || (max_m_filter > 0 && m > max_m_filter); }),
           ms.end());
  cublasHandle_t h;
  CK(cublasCreate(&h));
  CK(cudaStreamCreateWithFlags(&bench_stream, cudaStreamNonBlocking));  // every call and event goes here
  CK(cublasSetStream(h, bench_stream));
  // cuBLAS's workspace set once, so that its calls can be captured into graphs.
  void* cublas_ws = nullptr;
  CK(cudaMalloc(&cublas_ws, size_t(32) << 20));
  CK(cublasSetWorkspace(h, cublas_ws, size_t(32) << 20));
  const int64_t max_m = ms.back();
  FILE* fm = std::fopen(md.c_str(), "w");
  FILE* fc = std::fopen(csv.c_str(), "w");
  std::fprintf(fm, "| shape | product | M | samebits ms | cuBLAS ms | samebits TFLOP/s | cuBLAS TFLOP/s | samebits TB/s | ratio |\n");
  std::fprintf(fm, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  std::fprintf(fc, "shape,product,M,ours_ms,cublas_ms,ratio\n");
  std::string roofline;  // markdown rows: the weight-streaming ceiling against the forward at M <= 128
  uint32_t* sink = nullptr;
  CK(cudaMalloc(&sink, size_t(prop.multiProcessorCount) * 4 * sizeof(uint32_t)));
  for (const Shape& s : run_shapes) {
    // Enough copies of x / w that one rotation exceeds twice the L2 cache.
    const size_t w_bytes = size_t(s.N * s.K) * 2;
    const int copies = int(std::min<size_t>(8, std::max<size_t>(1, (size_t(prop.l2CacheSize) * 2) / w_bytes + 1)));
    std::vector<__nv_bfloat16*> w(static_cast<size_t>(copies)), x(static_cast<size_t>(copies)), dy(static_cast<size_t>(copies));
    for (int c = 0; c < copies; ++c) {
      CK(cudaMalloc(&w[c], w_bytes));
      CK(cudaMalloc(&x[c], size_t(max_m * s.K) * 2));
      CK(cudaMalloc(&dy[c], size_t(max_m * s.N) * 2));
      fill_random<<<1024, 256>>>(w[c], s.N * s.K, 1 + c);
      fill_random<<<1024, 256>>>(x[c], max_m * s.K, 100 + c);
      fill_random<<<1024, 256>>>(dy[c], max_m * s.N, 200 + c);
    }
    __nv_bfloat16 *y, *dx;
    float* dw;
    CK(cudaMalloc(&y, size_t(max_m * s.N) * 2));
    CK(cudaMalloc(&dx, size_t(max_m * s.K) * 2));
    CK(cudaMalloc(&dw, size_t(s.N * s.K) * 4));
    CK(cudaMemset(dw, 0, size_t(s.N * s.K) * 4));
    CK(cudaDeviceSynchronize());  // the fills ran on the legacy stream, which bench_stream does not wait for
    Context ctx;
    ctx.backend = Backend::cuda;
    ctx.stream = bench_stream;
    const float one = 1.0f, zero = 0.0f;
    double best_ours = 0, best_cublas = 0;  // forward weight streaming at M <= 128, TB/s
    for (const char* product : {"forward", "dX", "dW"}) {
      if (!product_filter.empty() && product_filter != product) continue;
      for (int64_t M : ms) {
        const double flop = 2.0 * double(M) * double(s.N) * double(s.K);
        PairMs ms{};
        if (!s.parts.empty()) {  // forward only: one grouped call against a cuBLAS call a part
          if (std::strcmp(product, "forward")) continue;
          ms = time_pair([&](int i) {
            const int c = i % copies;
            LinearGroupForwardArgs g;
            g.x = dev(x[c], DType::bf16, M, s.K);
            int64_t row = 0;
            for (int64_t n : s.parts) {
              g.parts[g.count++] = {dev(w[c] + row * s.K, DType::bf16, n, s.K), {}, dev(y + M * row, DType::bf16, M, n)};
              row += n;
            }
            linear_group_forward(ctx, g);
          }, [&](int i) {
            const int c = i % copies;
            int64_t row = 0;
            for (int64_t n : s.parts) {
              CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(M), int(s.K), &one, w[c] + row * s.K, CUDA_R_16BF,
                              int(s.K), x[c], CUDA_R_16BF, int(s.K), &zero, y + M * row, CUDA_R_16BF, int(n),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
              row += n;
            }
          }, 50);
        } else if (!std::strcmp(product, "forward")) {
          ms = time_pair([&](int i) {
            const int c = i % copies;
            linear_forward(ctx, {dev(x[c], DType::bf16, M, s.K), dev(w[c], DType::bf16, s.N, s.K), {}, dev(y, DType::bf16, M, s.N)});
          }, [&](int i) {
            const int c = i % copies;
            CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(s.N), int(M), int(s.K), &one, w[c], CUDA_R_16BF, int(s.K),
                            x[c], CUDA_R_16BF, int(s.K), &zero, y, CUDA_R_16BF, int(s.N), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
          }, 50);
        } else if (!std::strcmp(product, "dX")) {
          ms = time_pair([&](int i) {
            const int c = i % copies;
            linear_backward_input(ctx, {dev(dy[c], DType::bf16, M, s.N), dev(w[c], DType::bf16, s.N, s.K), dev(dx, DType::bf16, M, s.K)});
          }, [&](int i) {
            const int c = i % copies;
            CK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, int(s.K), int(M), int(s.N), &one, w[c], CUDA_R_16BF, int(s.K),
                            dy[c], CUDA_R_16BF, int(s.N), &zero, dx, CUDA_R_16BF, int(s.K), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
          }, 50);
        } else {
          ms = time_pair([&](int i) {
            const int c = i % copies;
            linear_backward_weight(ctx, {dev(dy[c], DType::bf16, M, s.N), dev(x[c], DType::bf16, M, s.K), {},
                                         dev(dw, DType::f32, s.N, s.K), {}});
          }, [&](int i) {
            const int c = i % copies;
            CK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, int(s.K), int(s.N), int(M), &one, x[c], CUDA_R_16BF, int(s.K),
                            dy[c], CUDA_R_16BF, int(s.N), &one, dw, CUDA_R_32F, int(s.K), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
          }, 20);
        }
        const double ours = ms.ours, theirs = ms.theirs;
        if (!std::strcmp(product, "forward") && M <= 128) {
          const double wb = double(w_bytes) + 2.0 * double(M) * double(s.K + s.N);
          best_ours = std::max(best_ours, wb / ours * 1e-9);
          best_cublas = std::max(best_cublas, wb / theirs * 1e-9);
        }
        const double bytes = std::strcmp(product, "dW") ? double(w_bytes) + 2.0 * double(M) * double(s.K + s.N)
                                                        : 8.0 * double(s.N * s.K) + 2.0 * double(M) * double(s.K + s.N);
        std::fprintf(fm, "| %s | %s | %lld | %.3f | %.3f | %.1f | %.1f | %.2f | %.3f |\n", s.name, product,
                     (long long)M, ours, theirs, flop / ours * 1e-9, flop / theirs * 1e-9, bytes / ours * 1e-9,
                     theirs / ours);
        std::fprintf(fc, "%s,%s,%lld,%.5f,%.5f,%.4f\n", s.name, product, (long long)M, ours, theirs, theirs / ours);
        std::fflush(fm);
        std::fflush(fc);
        std::printf("%-30s %-8s M=%-5lld ours %8.3f ms  cuBLAS %8.3f ms  ratio %.3f\n", s.name, product, (long long)M,
                    ours, theirs, theirs / ours);
        std::fflush(stdout);
      }
    }
    if (best_ours > 0) {
      const double read_ms = time_pair([&](int i) {
        stream_read<<<prop.multiProcessorCount * 4, 512, 0, bench_stream>>>(reinterpret_cast<const uint4*>(w[i % copies]),
                                                           int64_t(w_bytes / 16), sink);
      }, [](int) {}, 50).ours;
      const double ceiling = double(w_bytes) / read_ms * 1e-9;
      // What a GEMM call costs beyond its weight stream: the same call at M = 1 with K = 64 (one k-tile:
      // pipeline fill, the MMAs, the epilogue, and the launch), less an empty kernel's launch, which
      // the bare read pays too. The weight stream plus that bounds the rate of a call this size.
      const double k64_ms = time_pair([&](int i) {
        const int c = i % copies;
        linear_forward(ctx, {dev(x[c], DType::bf16, 1, 64), dev(w[c], DType::bf16, s.N, 64), {}, dev(y, DType::bf16, 1, s.N)});
      }, [](int) {}, 50).ours;
      const double empty_ms = time_pair([&](int) { empty_kernel<<<prop.multiProcessorCount, 384, 0, bench_stream>>>(); }, [](int) {}, 50).ours;
      const double call_ceiling_tbs = double(w_bytes) / (read_ms + std::max(0.0, k64_ms - empty_ms)) * 1e-9;
      char row[320];
      std::snprintf(row, sizeof row, "| %s | %.1f | %.2f | %.1f | %.1f | %.2f | %.2f | %.2f | %.2f |\n", s.name,
                    double(w_bytes) / 1e6, ceiling, k64_ms * 1e3, empty_ms * 1e3, call_ceiling_tbs, best_ours, best_cublas,
                    best_ours / ceiling);
      roofline += row;
      std::printf("%-30s weight %.1f MB: bare read %.2f TB/s, K=64 call %.1f us, empty kernel %.1f us, read + call %.2f TB/s;"
                  " forward M<=128 best: samebits %.2f, cuBLAS %.2f TB/s\n",
                  s.name, double(w_bytes) / 1e6, ceiling, k64_ms * 1e3, empty_ms * 1e3, call_ceiling_tbs, best_ours, best_cublas);
    }
    for (int c = 0; c < copies; ++c) {
      cudaFree(w[c]);
      cudaFree(x[c]);
      cudaFree(dy[c]);
    }
    cudaFree(y);
    cudaFree(dx);
    cudaFree(dw);
  }
  if (!roofline.empty())
    std::fprintf(fm, "\nWeight streaming at M <= 128 against a bare read of the same bytes (one kernel call that only\n"
                     "reads the weight with every SM busy, launch and ramp included, timed the same way): the ceiling\n"
                     "a GEMM call of this size can reach on this card. A GEMM call also pays what a call with one\n"
                     "64-deep k-tile costs (samebits, M = 1, K = 64: pipeline fill, MMAs, epilogue, launch) beyond an\n"
                     "empty kernel's launch; \"read + call\" is the weight over the bare read's time plus that: about the best such a call can do.\n\n"
                     "| shape | weight MB | bare read TB/s | K = 64 call µs | empty kernel µs | read + call TB/s | samebits forward best TB/s | cuBLAS forward best TB/s | samebits / bare read |\n"
                     "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n%s", roofline.c_str());
  cudaFree(sink);
  std::fclose(fm);
  std::fclose(fc);
  std::printf("card: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  cublasDestroy(h);
  cudaFree(cublas_ws);
  cudaStreamDestroy(bench_stream);
  return 0;
}

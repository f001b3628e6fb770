// How long sample_tokens takes on this card, the cluster kernel (a row on 8 CTAs, compute
// capability 9.0) against the one-CTA kernel (other devices), for the Qwen3 vocab (151,936) at
// 1, 8 and 64 rows, under each setting; and whether the two drew the same bits (they must).
//
// Each measurement is a CUDA graph of CALLS back-to-back calls on a stream of its own (programmatic
// launches on, as in a decode step), timed with events and divided by CALLS: the GPU's time a call,
// with the host's launch cost out of it. The logits stay in L2 between calls, as after the LM head.
// Usage: build/bench_time_sampling [vocab] (a probe: bench/probes/time_sampling.cu, target
// bench_time_sampling).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ops/tuning.hpp"
#include "samebits/device.hpp"
#include "samebits/device_tensor.hpp"
#include "samebits/host_tensor.hpp"
#include "samebits/ops.hpp"
#include "samebits/rng.hpp"

using namespace samebits;

namespace {

constexpr int CALLS = 50;

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct Setting {
  const char* name;
  double temperature, top_k, top_p, min_p;
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t V = argc > 1 ? std::atoll(argv[1]) : 151936;
  const Setting settings[] = {{"greedy", 0, 0, 1, 0},
                              {"temperature 1", 1, 0, 1, 0},
                              {"top-k 50", 1, 50, 1, 0},
                              {"top-p 0.9", 1, 0, 0.9, 0},
                              {"top-k 50, top-p 0.9, min-p 0.05", 0.7, 50, 0.9, 0.05}};
  DeviceStream stream(Backend::cuda);
  Rng r(7);
  std::printf("vocab %lld, %d calls a graph; µs a call (cluster kernel / one-CTA kernel)\n", (long long)V, CALLS);
  std::printf("%-34s %6s %12s %12s %8s %s\n", "setting", "rows", "cluster", "one CTA", "ratio", "same bits");
  for (int64_t R : {1, 8, 64}) {
    HostTensor logits(DType::f32, {R, V});
    float* z = static_cast<float*>(logits.data());
    for (int64_t i = 0; i < R * V; ++i) z[i] = float(r.normal() * 3.0);
    const DeviceTensor d_logits = DeviceTensor::from_host(Backend::cuda, logits);
    for (const Setting& s : settings) {
      HostTensor params(DType::f64, {R, 5});
      double* p = static_cast<double*>(params.data());
      for (int64_t i = 0; i < R; ++i)
        p[i * 5 + 0] = s.temperature, p[i * 5 + 1] = s.top_k, p[i * 5 + 2] = s.top_p, p[i * 5 + 3] = s.min_p,
                  p[i * 5 + 4] = r.uniform(0, 1);
      const DeviceTensor d_params = DeviceTensor::from_host(Backend::cuda, params);
      float us[2];
      HostTensor drawn[2][3];
      for (int one_cta = 0; one_cta < 2; ++one_cta) {
        const detail::ScopedOverride<int> hook(detail::sampling_kernel_override(), one_cta ? 1 : 2);
        DeviceTensor tokens(Backend::cuda, DType::i32, {R}), kept(Backend::cuda, DType::u8, {R, V}),
            weights(Backend::cuda, DType::f32, {R, 2});
        Context ctx;
        ctx.backend = Backend::cuda;
        ctx.stream = stream.get();
        const SampleTokensArgs a{d_logits.view(), d_params.view(), tokens.view(), kept.view(), weights.view()};
        sample_tokens(ctx, a);  // outside the capture: the kernels' one-time set-up
        stream.synchronize();
        const auto s_ = static_cast<cudaStream_t>(stream.get());
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        ok(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal), "capture");
        for (int c = 0; c < CALLS; ++c) sample_tokens(ctx, a);
        ok(cudaStreamEndCapture(s_, &graph), "end capture");
        ok(cudaGraphInstantiateWithFlags(&exec, graph, 0), "instantiate");
        cudaEvent_t e0, e1;
        ok(cudaEventCreate(&e0), "event");
        ok(cudaEventCreate(&e1), "event");
        ok(cudaGraphLaunch(exec, s_), "warm-up");
        float best = 1e30f;
        for (int rep = 0; rep < 5; ++rep) {
          ok(cudaEventRecord(e0, s_), "record");
          ok(cudaGraphLaunch(exec, s_), "launch");
          ok(cudaEventRecord(e1, s_), "record");
          ok(cudaEventSynchronize(e1), "sync");
          float ms = 0;
          ok(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
          best = std::min(best, ms);
        }
        us[one_cta] = best * 1000.0f / CALLS;
        drawn[one_cta][0] = tokens.to_host(), drawn[one_cta][1] = kept.to_host(), drawn[one_cta][2] = weights.to_host();
        cudaEventDestroy(e0), cudaEventDestroy(e1);
        cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
      }
      bool same = true;
      for (int t = 0; t < 3; ++t)
        same = same && drawn[0][t].bytes() == drawn[1][t].bytes() &&
               std::memcmp(drawn[0][t].data(), drawn[1][t].data(), drawn[0][t].bytes()) == 0;
      std::printf("%-34s %6lld %12.1f %12.1f %8.2f %s\n", s.name, (long long)R, us[0], us[1], us[1] / us[0],
                  same ? "yes" : "NO");
    }
  }
  return 0;
}

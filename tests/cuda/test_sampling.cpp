// The CUDA sampling kernels against the CPU one (the rule's reference): the same token and the same
// kept set from the same fp32 rows, for every setting and vocab shape; the cluster kernel (compute
// capability 9.0) and the one-CTA kernel (other devices) alike, bit for bit; a row's token does not
// depend on the rows beside it; bad rows are reported in their token; the draws follow the softmax;
// a captured graph draws the eager call's tokens.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/captured_graph.hpp"
#include "ops/tuning.hpp"
#include "samebits/device.hpp"
#include "tests/cuda/cuda_test_util.hpp"
#include "samebits/ops.hpp"
#include "samebits/sampling.hpp"

namespace {

struct Rows {
  HostTensor logits, params;
};

// R rows of V logits (normal · 3, with ties, −inf entries and a few exact duplicates of the max)
// and random settings: greedy, temperature only, top-k, top-p, min-p, all of them.
Rows random_rows(Rng& r, int64_t R, int64_t V) {
  Rows rows{HostTensor(DType::f32, {R, V}), HostTensor(DType::f64, {R, 5})};
  for (int64_t i = 0; i < R; ++i) {
    float* z = static_cast<float*>(rows.logits.data()) + i * V;
    const double scale = r.uniform(0.5, 6.0);
    for (int64_t j = 0; j < V; ++j) z[j] = float(r.normal() * scale);
    if (V > 8) {
      z[5] = z[2];                                    // a tie anywhere
      z[7] = -std::numeric_limits<float>::infinity();  // never drawn
    }
    if (V > 20 && i % 4 == 0)
      for (int64_t j = 10; j < 20; ++j) z[j] = z[1];  // a block of ties: top-k / top-p cuts land in it
    const int kind = int(i % 6);
    double* p = static_cast<double*>(rows.params.data()) + i * 5;
    p[0] = kind == 0 ? 0.0 : r.uniform(0.2, 2.0);
    p[1] = (kind == 2 || kind == 5) ? double(r.integer(1, std::max<int64_t>(1, std::min<int64_t>(V, 200)))) : 0.0;
    p[2] = (kind == 3 || kind == 5) ? r.uniform(0.05, 1.0) : 1.0;
    p[3] = (kind == 4 || kind == 5) ? r.uniform(0.0, 0.3) : 0.0;
    p[4] = r.uniform(0.0, 1.0);
  }
  return rows;
}

// R rows of V logits shaped to reach every corner of the kernels — ties everywhere (top-k's cut
// inside a run of ties: the tie-id search), one value throughout, mostly −inf, weights underflowing
// to 0, a max tied at two far ids, ±0, a single finite logit, many logits one or two floats below
// the max (cuts one key apart) — under every setting, extreme temperatures, a top-p goal that rounds
// to 0, u at 0 and next to 1.
Rows hard_rows(Rng& r, int64_t R, int64_t V) {
  Rows rows{HostTensor(DType::f32, {R, V}), HostTensor(DType::f64, {R, 5})};
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t salt = r.integer(0, 80);  // which (shape, setting) pairs a call's rows start from
  for (int64_t i = 0; i < R; ++i) {
    float* z = static_cast<float*>(rows.logits.data()) + i * V;
    const double scale = r.uniform(0.5, 6.0);
    const int shape = int((i + salt) % 9);  // with the setting below, every pair in 81 rows
    for (int64_t j = 0; j < V; ++j) {
      const double n = r.normal();
      switch (shape) {
        case 1: z[j] = float(std::floor(n * 3)); break;               // integers: many ties
        case 2: z[j] = 1.5f; break;                                   // one value throughout
        case 3: z[j] = r.integer(0, 2) ? -inf : float(n * scale); break;  // mostly −inf
        case 4: z[j] = float(n * 40); break;                          // most weights underflow
        case 6: z[j] = r.integer(0, 1) ? -0.0f : 0.0f; break;         // ±0
        case 7: z[j] = -inf; break;                                   // one finite logit (below)
        case 8: {                                                     // the max's neighbours
          const float below = std::nextafter(20.0f, -inf);
          const int64_t u = r.integer(0, 11);
          z[j] = u == 0 ? 20.0f : u < 4 ? below : u < 6 ? std::nextafter(below, -inf) : float(n * scale);
          break;
        }
        default: z[j] = float(n * scale);
      }
    }
    if (shape == 5 && V > 3) z[V - 1] = z[V / 3] = 40.0f;  // the max at two far ids
    if (shape == 7) z[r.integer(0, V - 1)] = float(r.normal());
    if (V > 8 && shape != 7) {
      z[5] = z[2];
      z[7] = -inf;
    }
    const int kind = int((4 * i + salt / 9) % 9);
    double* p = static_cast<double*>(rows.params.data()) + i * 5;
    const int64_t kmax = r.integer(0, 1) ? std::min<int64_t>(V, 200) : V;
    p[0] = kind == 0 ? 0.0 : kind == 6 ? 1e-30 : kind == 7 ? 1e30 : r.uniform(0.2, 2.0);
    p[1] = (kind == 2 || kind == 5 || kind == 6) ? double(r.integer(1, kmax)) : 0.0;
    p[2] = (kind == 3 || kind == 5 || kind == 7) ? r.uniform(0.05, 1.0) : kind == 8 ? 1e-60 : 1.0;
    p[3] = (kind == 4 || kind == 5) ? r.uniform(0.0, 0.3) : 0.0;
    p[4] = i % 7 == 0 ? 0.0 : i % 7 == 1 ? 0.9999999999 : r.uniform(0.0, 1.0);
  }
  return rows;
}

struct Drawn {
  HostTensor tokens, kept, weights;  // weights: {drawn token's, kept total} a row
};

// kernel: the CUDA backend's schedule (0), its one-CTA kernel (1) or its cluster kernel wherever the
// device runs it, whatever the row count (2): detail::sampling_kernel_override.
Drawn draw(Backend b, const Rows& rows, int kernel = 0) {
  const detail::ScopedOverride<int> hook(detail::sampling_kernel_override(), kernel);
  const int64_t R = rows.logits.shape()[0], V = rows.logits.shape()[1];
  Context ctx;
  ctx.backend = b;
  const DeviceTensor logits = DeviceTensor::from_host(b, rows.logits), params = DeviceTensor::from_host(b, rows.params);
  DeviceTensor tokens(b, DType::i32, {R}), kept(b, DType::u8, {R, V}), weights(b, DType::f32, {R, 2});
  sample_tokens(ctx, {logits.view(), params.view(), tokens.view(), kept.view(), weights.view()});
  return {tokens.to_host(), kept.to_host(), weights.to_host()};
}

// Row by row, the same token, kept set and weights, bit for bit (the first rows that differ named).
void expect_same_draws(const Drawn& got, const Drawn& want, const std::string& what) {
  const int64_t R = want.tokens.shape()[0], V = want.kept.shape()[1];
  ASSERT_EQ(got.tokens.shape()[0], R) << what;
  int reported = 0;
  for (int64_t i = 0; i < R && reported < 5; ++i) {
    const int32_t a = static_cast<const int32_t*>(got.tokens.data())[i];
    const int32_t b = static_cast<const int32_t*>(want.tokens.data())[i];
    const bool kept = std::memcmp(static_cast<const uint8_t*>(got.kept.data()) + i * V,
                                  static_cast<const uint8_t*>(want.kept.data()) + i * V, size_t(V)) == 0;
    const bool w = std::memcmp(static_cast<const float*>(got.weights.data()) + 2 * i,
                               static_cast<const float*>(want.weights.data()) + 2 * i, 8) == 0;
    if (a != b || !kept || !w) {
      ADD_FAILURE() << what << ", row " << i << ": token " << a << " vs " << b << (kept ? "" : ", kept sets differ")
                    << (w ? "" : ", weights differ");
      ++reported;
    }
  }
}

}  // namespace

class CudaSampling : public CudaTest {};

TEST_F(CudaSampling, DrawsTheCpuKernelsTokensAndSets) {
  Rng r(41);
  for (int64_t V : {1, 7, 1000, 1024, 1025, 2560, 4097, 151936}) {
    const int64_t R = V > 10000 ? 48 : 96;
    const Rows rows = random_rows(r, R, V);
    const Drawn gpu = draw(Backend::cuda, rows), cpu = draw(Backend::cpu, rows);
    for (int64_t i = 0; i < R; ++i) {
      EXPECT_EQ(static_cast<const int32_t*>(gpu.tokens.data())[i], static_cast<const int32_t*>(cpu.tokens.data())[i])
          << "V " << V << " row " << i;
      EXPECT_GE(static_cast<const int32_t*>(gpu.tokens.data())[i], 0) << "V " << V << " row " << i;
    }
    expect_same_bits(gpu.kept, cpu.kept, "kept sets, V " + std::to_string(V));
    // The draw's own numbers (the sampling logprob's), bitwise the CPU kernel's.
    expect_same_bits(gpu.weights, cpu.weights, "weights, V " + std::to_string(V));
  }
}

// The cluster kernel (where the device runs it) and the one-CTA kernel against the CPU kernel, bit
// for bit, on rows built to reach every branch: vocabs below one stride, not a multiple of it, the
// Qwen3 vocab and the largest the cluster kernel holds (226,304 ids; one more goes to the one-CTA
// kernel); 1, 3 and 64 rows a call.
TEST_F(CudaSampling, ClusterAndOneCtaKernelsDrawTheCpuKernelsBits) {
  Rng r(44);
  for (int64_t V : {1, 2, 7, 1000, 1024, 1025, 4099, 20000, 151936, 226304, 226305}) {
    for (int64_t R : {1, 3, 64}) {
      if (V > 100000 && R == 3) continue;
      const Rows rows = hard_rows(r, R, V);
      const std::string what = "V " + std::to_string(V) + ", " + std::to_string(R) + " rows";
      const Drawn cpu = draw(Backend::cpu, rows), gpu = draw(Backend::cuda, rows);
      const Drawn one = draw(Backend::cuda, rows, 1), cluster = draw(Backend::cuda, rows, 2);
      expect_same_draws(gpu, cpu, what + " (the CUDA schedule against the CPU kernel)");
      expect_same_draws(one, cpu, what + " (the one-CTA kernel against the CPU one)");
      expect_same_draws(cluster, cpu, what + " (the cluster kernel against the CPU one)");
    }
  }
}

// The rows of the test above in random order of settings, and a row's result alone: the same bits
// from both CUDA kernels (the rows of one call never interact).
TEST_F(CudaSampling, ClusterAndOneCtaKernelsAgreeRowByRow) {
  Rng r(45);
  for (int64_t V : {1000, 32000, 151936}) {
    const Rows rows = random_rows(r, 72, V);
    expect_same_draws(draw(Backend::cuda, rows, 2), draw(Backend::cuda, rows, 1),
                      "V " + std::to_string(V) + ": the cluster kernel against the one-CTA kernel");
  }
}

// A bad row among good ones: its code, {0, 0} and no kept id; its neighbours drawn as alone. Both
// CUDA kernels, the vocab of Qwen3.
TEST_F(CudaSampling, ABadRowLeavesItsNeighboursAlone) {
  Rng r(46);
  const int64_t R = 6, V = 151936;
  Rows rows = random_rows(r, R, V);
  float* z = static_cast<float*>(rows.logits.data());
  z[1 * V + 151935] = std::numeric_limits<float>::quiet_NaN();  // the last id: the last CTA's last stride
  z[3 * V + 0] = std::numeric_limits<float>::infinity();
  static_cast<double*>(rows.params.data())[4 * 5 + 0] = -1.0;  // temperature < 0
  const Drawn cpu = draw(Backend::cpu, rows);
  for (int kernel : {1, 2}) {
    const Drawn d = draw(Backend::cuda, rows, kernel);
    expect_same_draws(d, cpu, kernel == 1 ? "one-CTA kernel" : "cluster kernel");
    const int32_t* t = static_cast<const int32_t*>(d.tokens.data());
    EXPECT_EQ(t[1], -1);
    EXPECT_EQ(t[3], -1);
    EXPECT_EQ(t[4], -2);
    for (int64_t i : {0, 2, 5}) EXPECT_GE(t[i], 0) << "row " << i;
  }
}

// The draw captured into a CUDA graph (as the engine captures decode steps, a stream of its own,
// programmatic launches on) gives the eager call's bits at every replay.
TEST_F(CudaSampling, ACapturedDrawGivesTheEagerBits) {
  if (!captured_graphs_available(Backend::cuda)) GTEST_SKIP() << "no captured graphs on this device";
  Rng r(47);
  const int64_t R = 5, V = 151936;
  const Rows rows = random_rows(r, R, V);
  const DeviceStream stream(Backend::cuda);
  Context ctx;
  ctx.backend = Backend::cuda;
  ctx.stream = stream.get();
  const DeviceTensor logits = DeviceTensor::from_host(Backend::cuda, rows.logits),
                     params = DeviceTensor::from_host(Backend::cuda, rows.params);
  DeviceTensor tokens(Backend::cuda, DType::i32, {R}), kept(Backend::cuda, DType::u8, {R, V}),
      weights(Backend::cuda, DType::f32, {R, 2});
  GraphAttentionShape shape;
  shape.seqs = 1, shape.max_k_len = 16, shape.q_heads = 1, shape.kv_heads = 1, shape.head_dim = 128;
  CapturedGraph graph(stream.get(), [&] {
    sample_tokens(ctx, {logits.view(), params.view(), tokens.view(), kept.view(), weights.view()});
  }, shape);
  const Drawn eager = draw(Backend::cuda, rows);
  for (int replay = 0; replay < 2; ++replay) {
    graph.replay(nullptr, 0);
    stream.synchronize();
    expect_same_draws({tokens.to_host(), kept.to_host(), weights.to_host()}, eager, "replay " + std::to_string(replay));
  }
}

TEST_F(CudaSampling, ARowsTokenDoesNotDependOnItsNeighbours) {
  Rng r(42);
  const int64_t R = 40, V = 32000;
  const Rows rows = random_rows(r, R, V);
  const Drawn all = draw(Backend::cuda, rows);
  for (int64_t i : {0, 13, 39}) {
    Rows one{HostTensor(DType::f32, {1, V}), HostTensor(DType::f64, {1, 5})};
    std::memcpy(one.logits.data(), static_cast<const float*>(rows.logits.data()) + i * V, size_t(V) * 4);
    std::memcpy(one.params.data(), static_cast<const double*>(rows.params.data()) + i * 5, 5 * 8);
    const Drawn alone = draw(Backend::cuda, one);
    EXPECT_EQ(static_cast<const int32_t*>(alone.tokens.data())[0], static_cast<const int32_t*>(all.tokens.data())[i]);
    EXPECT_EQ(std::memcmp(alone.kept.data(), static_cast<const uint8_t*>(all.kept.data()) + i * V, size_t(V)), 0);
    EXPECT_EQ(std::memcmp(alone.weights.data(), static_cast<const float*>(all.weights.data()) + 2 * i, 8), 0);
  }
  const Drawn again = draw(Backend::cuda, rows);
  expect_same_bits(again.tokens, all.tokens, "a second launch");
}

TEST_F(CudaSampling, BadRowsAreReportedAndTheOthersDrawn) {
  Rng r(43);
  const int64_t R = 6, V = 3000;
  Rows rows = random_rows(r, R, V);
  float* z = static_cast<float*>(rows.logits.data());
  double* p = static_cast<double*>(rows.params.data());
  z[1 * V + 17] = std::numeric_limits<float>::quiet_NaN();
  z[2 * V + 2999] = std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < V; ++j) z[3 * V + j] = -std::numeric_limits<float>::infinity();
  p[4 * 5 + 2] = 0.0;  // top_p = 0
  for (Backend b : {Backend::cuda, Backend::cpu}) {
    const Drawn d = draw(b, rows);
    const int32_t* t = static_cast<const int32_t*>(d.tokens.data());
    EXPECT_GE(t[0], 0);
    EXPECT_EQ(t[1], -1);
    EXPECT_EQ(t[2], -1);
    EXPECT_EQ(t[3], -1);
    EXPECT_EQ(t[4], -2);
    EXPECT_GE(t[5], 0);
    const float* w = static_cast<const float*>(d.weights.data());
    for (int64_t i : {1, 2, 3, 4}) EXPECT_TRUE(w[2 * i] == 0.0f && w[2 * i + 1] == 0.0f) << "bad row " << i;
    for (int64_t i : {0, 5}) EXPECT_TRUE(w[2 * i] > 0.0f && w[2 * i + 1] >= w[2 * i]) << "row " << i;
  }
  expect_same_bits(draw(Backend::cuda, rows).weights, draw(Backend::cpu, rows).weights, "weights with bad rows");
}

TEST_F(CudaSampling, FrequenciesFollowTheTemperedSoftmax) {
  const std::vector<float> logits{1.0f, -0.5f, 2.0f, 0.3f, 0.3f, -2.0f, 1.1f, 0.0f};
  const int64_t N = 100000, V = int64_t(logits.size());
  for (double T : {1.0, 0.7}) {
    Rows rows{HostTensor(DType::f32, {N, V}), HostTensor(DType::f64, {N, 5})};
    for (int64_t i = 0; i < N; ++i) {
      std::memcpy(static_cast<float*>(rows.logits.data()) + i * V, logits.data(), size_t(V) * 4);
      double* p = static_cast<double*>(rows.params.data()) + i * 5;
      p[0] = T, p[1] = 0, p[2] = 1, p[3] = 0, p[4] = sampling_uniform(99, 0, i);
    }
    const Drawn d = draw(Backend::cuda, rows);
    std::vector<int64_t> count(size_t(V), 0);
    for (int64_t i = 0; i < N; ++i) ++count[size_t(static_cast<const int32_t*>(d.tokens.data())[i])];
    double z = 0, chi2 = 0;
    for (float l : logits) z += std::exp(double(l) / T);
    for (int64_t j = 0; j < V; ++j) {
      const double expected = double(N) * std::exp(double(logits[size_t(j)]) / T) / z;
      chi2 += (double(count[size_t(j)]) - expected) * (double(count[size_t(j)]) - expected) / expected;
    }
    EXPECT_LT(chi2, 24.32) << "chi-square, 7 degrees of freedom, p = 0.001; T = " << T;
  }
}

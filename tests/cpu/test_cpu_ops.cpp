// CPU reference ops against independent, naive formulas (so the fp64 truth and the fp32 backend do
// not share a bug unseen), exact integer GEMMs, and the bitwise identities the design promises:
// fused LM head == linear + logprob, decode == prefill, masked rows are exact zeros.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "samebits/ops.hpp"

using namespace samebits;
using harness::Rng;

namespace {

Context truth() {
  Context c;
  c.precision = Precision::truth_fp64;
  return c;
}

std::vector<float> random_floats(Rng& r, size_t n, double lo, double hi) {
  std::vector<float> v(n);
  for (auto& x : v) x = float(r.uniform(lo, hi));
  return v;
}

template <class T>
TensorView view(std::vector<T>& v, DType d, std::initializer_list<int64_t> shape) {
  return TensorView::of(v.data(), d, shape);
}

}  // namespace

TEST(CpuOps, IntegerGemmIsExactInEveryMode) {
  // Integer inputs keep fp32 accumulation exact (CUTLASS's trick): any order gives the same sum,
  // so the result must equal the int64 product exactly.
  const int M = 5, N = 7, K = 37;
  Rng r(1);
  std::vector<float> x(M * K), w(N * K), y(M * N);
  for (auto& v : x) v = float(r.integer(-8, 8));
  for (auto& v : w) v = float(r.integer(-8, 8));
  LinearForwardArgs a;
  a.x = view(x, DType::f32, {M, K});
  a.weight = view(w, DType::f32, {N, K});
  a.y = view(y, DType::f32, {M, N});
  linear_forward(Context{}, a);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      int64_t s = 0;
      for (int k = 0; k < K; ++k) s += int64_t(x[m * K + k]) * int64_t(w[n * K + k]);
      ASSERT_EQ(y[m * N + n], float(s));
    }
}

TEST(CpuOps, TruthRmsNormMatchesNaiveFormula) {
  const int T = 3, H = 11;
  Rng r(2);
  std::vector<double> x(T * H), w(H), y(T * H), rstd(T);
  for (auto& v : x) v = r.uniform(-2, 2);
  for (auto& v : w) v = r.uniform(0.5, 1.5);
  RmsNormForwardArgs a;
  a.x = view(x, DType::f64, {T, H});
  a.weight = view(w, DType::f64, {H});
  a.y = view(y, DType::f64, {T, H});
  a.rstd = view(rstd, DType::f64, {T});
  a.eps = 1e-5;
  rmsnorm_forward(truth(), a);
  for (int t = 0; t < T; ++t) {
    double ss = 0;
    for (int i = 0; i < H; ++i) ss += x[t * H + i] * x[t * H + i];
    const double rs = 1.0 / std::sqrt(ss / H + 1e-5);
    EXPECT_NEAR(rstd[t], rs, 1e-14);
    for (int i = 0; i < H; ++i) EXPECT_NEAR(y[t * H + i], x[t * H + i] * rs * w[i], 1e-13);
  }
}

TEST(CpuOps, TruthLogprobAndEntropyMatchNaiveFormula) {
  const int T = 2, V = 4099;  // three vocab blocks, the last one partial
  Rng r(3);
  std::vector<double> z(T * V), logp(T), ent(T);
  for (auto& v : z) v = 4 * r.normal();
  std::vector<int32_t> tg{17, 4098};
  LogprobForwardArgs a;
  a.logits = view(z, DType::f64, {T, V});
  a.targets = view(tg, DType::i32, {T});
  a.logp = view(logp, DType::f64, {T});
  a.entropy = view(ent, DType::f64, {T});
  logprob_forward(truth(), a);
  for (int t = 0; t < T; ++t) {
    double m = -INFINITY, s = 0, h = 0;
    for (int j = 0; j < V; ++j) m = std::max(m, z[t * V + j]);
    for (int j = 0; j < V; ++j) s += std::exp(z[t * V + j] - m);
    const double lse = m + std::log(s);
    for (int j = 0; j < V; ++j) {
      const double lp = z[t * V + j] - lse;
      h -= std::exp(lp) * lp;
    }
    EXPECT_NEAR(logp[t], z[t * V + tg[t]] - lse, 1e-12);
    EXPECT_NEAR(ent[t], h, 1e-11);
  }
}

TEST(CpuOps, TruthAttentionMatchesNaiveSoftmax) {
  const int L = 9, Hq = 4, Hkv = 2, D = 8;
  Rng r(4);
  std::vector<double> q(L * Hq * D), k(L * Hkv * D), v(L * Hkv * D), out(L * Hq * D);
  for (auto* t : {&q, &k, &v})
    for (auto& x : *t) x = r.uniform(-2, 2);
  std::vector<int32_t> seqs{0, L, 0, L};
  AttentionForwardArgs a;
  a.q = view(q, DType::f64, {L, Hq, D});
  a.k = view(k, DType::f64, {L, Hkv, D});
  a.v = view(v, DType::f64, {L, Hkv, D});
  a.out = view(out, DType::f64, {L, Hq, D});
  a.seqs = view(seqs, DType::i32, {1, 4});
  attention_forward(truth(), a);
  for (int i = 0; i < L; ++i)
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / (Hq / Hkv);
      std::vector<double> p(i + 1);
      double sum = 0;
      for (int j = 0; j <= i; ++j) {
        double s = 0;
        for (int d = 0; d < D; ++d) s += q[(i * Hq + h) * D + d] * k[(j * Hkv + hk) * D + d];
        p[j] = std::exp(s / std::sqrt(double(D)));
        sum += p[j];
      }
      for (int d = 0; d < D; ++d) {
        double o = 0;
        for (int j = 0; j <= i; ++j) o += p[j] / sum * v[(j * Hkv + hk) * D + d];
        EXPECT_NEAR(out[(i * Hq + h) * D + d], o, 1e-12);
      }
    }
}

TEST(CpuOps, RopeAtPositionZeroIsIdentityAndBackwardInvertsForward) {
  const int T = 3, H = 2, D = 16;
  Rng r(5);
  auto x = random_floats(r, T * H * D, -2, 2);
  std::vector<float> y(x.size()), back(x.size());
  std::vector<int32_t> pos{0, 77, 9000};
  RopeArgs a;
  a.x = view(x, DType::f32, {T, H, D});
  a.y = view(y, DType::f32, {T, H, D});
  a.positions = view(pos, DType::i32, {T});
  rope_forward(Context{}, a);
  EXPECT_EQ(std::memcmp(x.data(), y.data(), H * D * 4), 0);  // cos 0 = 1, sin 0 = 0, bitwise
  RopeArgs b = a;
  b.x = a.y;
  b.y = view(back, DType::f32, {T, H, D});
  rope_backward(Context{}, b);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 2e-6);
  // Qwen3 convention: dims i and i + D/2 rotate together with inv_freq[i] = theta^(-2i/D).
  const double angle = double(float(77) * float(1.0 / std::pow(1e6, 2.0 * 3 / D)));
  const int t = 1, i = 3;
  const double expect = x[(t * H) * D + i] * std::cos(angle) - x[(t * H) * D + i + D / 2] * std::sin(angle);
  EXPECT_NEAR(y[(t * H) * D + i], expect, 1e-6);
}

// QK-norm fused with RoPE: the forward is qk_norm_forward then rope_forward in place, bit for bit
// (the normed rows rounded to y's bf16 before they rotate); the backward is rope_backward into an
// fp32 tensor, then qk_norm_backward — not a bf16 round trip of the rotated gradient.
TEST(CpuOps, QkNormRopeIsQkNormThenRope) {
  const int64_t T = 5, heads = 3, D = 32;
  Rng r(8);
  const harness::HostTensor x = r.tensor(DType::bf16, {T, heads, D}, -2, 2), dy = r.tensor(DType::bf16, {T, heads, D}, -1, 1),
                            w = r.tensor(DType::bf16, {D}, 0.5, 1.5);
  std::vector<int32_t> pos{0, 1, 0, 4000, 99999};
  harness::HostTensor y_ref(DType::bf16, {T, heads, D}), y_fused(DType::bf16, {T, heads, D});
  QkNormForwardArgs f;
  f.x = x.view();
  f.weight = w.view();
  f.y = y_ref.view();
  qk_norm_forward(Context{}, f);
  rope_forward(Context{}, {y_ref.view(), view(pos, DType::i32, {T}), y_ref.view(), RopeConfig{}});
  f.y = y_fused.view();
  f.positions = view(pos, DType::i32, {T});
  qk_norm_forward(Context{}, f);
  EXPECT_EQ(std::memcmp(y_fused.data(), y_ref.data(), y_ref.bytes()), 0);
  harness::HostTensor rotated(DType::f32, {T, heads, D}), rotated_bf16(DType::bf16, {T, heads, D});
  rope_backward(Context{}, {dy.view(), view(pos, DType::i32, {T}), rotated.view(), RopeConfig{}});
  rope_backward(Context{}, {dy.view(), view(pos, DType::i32, {T}), rotated_bf16.view(), RopeConfig{}});
  std::vector<float> dw_ref(D, 0.25f), dw_fused(D, 0.25f), dw_bf16(D, 0.25f);
  harness::HostTensor dx_ref(DType::bf16, {T, heads, D}), dx_fused(DType::bf16, {T, heads, D}), dx_bf16(DType::bf16, {T, heads, D});
  QkNormBackwardArgs b;
  b.x = x.view();
  b.weight = w.view();
  b.dy = rotated.view();
  b.dx = dx_ref.view();
  b.dweight = view(dw_ref, DType::f32, {D});
  qk_norm_backward(Context{}, b);
  b.dy = rotated_bf16.view();
  b.dx = dx_bf16.view();
  b.dweight = view(dw_bf16, DType::f32, {D});
  qk_norm_backward(Context{}, b);
  b.dy = dy.view();
  b.dx = dx_fused.view();
  b.dweight = view(dw_fused, DType::f32, {D});
  b.positions = view(pos, DType::i32, {T});
  qk_norm_backward(Context{}, b);
  EXPECT_EQ(std::memcmp(dx_fused.data(), dx_ref.data(), dx_ref.bytes()), 0);
  EXPECT_EQ(std::memcmp(dw_fused.data(), dw_ref.data(), D * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(dw_fused.data(), dw_bf16.data(), D * sizeof(float)), 0);  // not via bf16
}

TEST(CpuOps, FusedLmHeadEqualsLinearThenLogprobBitwise) {
  const int T = 6, H = 24, V = 4500;
  Rng r(6);
  auto hidden = random_floats(r, T * H, -1, 1), w = random_floats(r, V * H, -0.5, 0.5);
  std::vector<int32_t> tg{3, 4499, -100, 2048, 0, 100};
  std::vector<uint8_t> mask{1, 1, 1, 0, 1, 1};
  std::vector<float> logits(T * V), lp1(T), en1(T), lse1(T), lp2(T), en2(T), lse2(T);

  LinearForwardArgs lin;
  lin.x = view(hidden, DType::f32, {T, H});
  lin.weight = view(w, DType::f32, {V, H});
  lin.y = view(logits, DType::f32, {T, V});
  linear_forward(Context{}, lin);
  LogprobForwardArgs lp;
  lp.logits = lin.y;
  lp.targets = view(tg, DType::i32, {T});
  lp.loss_mask = view(mask, DType::u8, {T});
  lp.logp = view(lp1, DType::f32, {T});
  lp.entropy = view(en1, DType::f32, {T});
  lp.lse = view(lse1, DType::f32, {T});
  logprob_forward(Context{}, lp);

  LmHeadLogprobForwardArgs fused;
  fused.hidden = lin.x;
  fused.weight = lin.weight;
  fused.targets = lp.targets;
  fused.loss_mask = lp.loss_mask;
  fused.logp = view(lp2, DType::f32, {T});
  fused.entropy = view(en2, DType::f32, {T});
  fused.lse = view(lse2, DType::f32, {T});
  lm_head_logprob_forward(Context{}, fused);
  EXPECT_EQ(std::memcmp(lp1.data(), lp2.data(), T * 4), 0);
  EXPECT_EQ(std::memcmp(en1.data(), en2.data(), T * 4), 0);
  EXPECT_EQ(std::memcmp(lse1.data(), lse2.data(), T * 4), 0);
  EXPECT_EQ(lp2[2], 0.0f);  // ignore_index
  EXPECT_EQ(lp2[3], 0.0f);  // masked

  // Backward: logprob_backward (fp32 dlogits) + linear dX + linear dW (masked rows skipped).
  auto dlogp = random_floats(r, T, -1, 1), dent = random_floats(r, T, -1, 1);
  std::vector<float> dlogits(T * V), dh1(T * H), dh2(T * H), dw1(V * H, 0.25f), dw2(V * H, 0.25f);
  LogprobBackwardArgs lb;
  lb.logits = lin.y;
  lb.targets = lp.targets;
  lb.loss_mask = lp.loss_mask;
  lb.dlogp = view(dlogp, DType::f32, {T});
  lb.dentropy = view(dent, DType::f32, {T});
  lb.dlogits = view(dlogits, DType::f32, {T, V});
  logprob_backward(Context{}, lb);
  LinearBackwardInputArgs bi;
  bi.dy = lb.dlogits;
  bi.weight = lin.weight;
  bi.dx = view(dh1, DType::f32, {T, H});
  linear_backward_input(Context{}, bi);
  std::vector<uint8_t> active{1, 1, 0, 0, 1, 1};
  LinearBackwardWeightArgs bw;
  bw.dy = lb.dlogits;
  bw.x = lin.x;
  bw.row_mask = view(active, DType::u8, {T});
  bw.dweight = view(dw1, DType::f32, {V, H});
  linear_backward_weight(Context{}, bw);

  LmHeadLogprobBackwardArgs fb;
  fb.hidden = lin.x;
  fb.weight = lin.weight;
  fb.targets = lp.targets;
  fb.loss_mask = lp.loss_mask;
  fb.dlogp = lb.dlogp;
  fb.dentropy = lb.dentropy;
  fb.dhidden = view(dh2, DType::f32, {T, H});
  fb.dweight = view(dw2, DType::f32, {V, H});
  lm_head_logprob_backward(Context{}, fb);
  EXPECT_EQ(std::memcmp(dh1.data(), dh2.data(), dh1.size() * 4), 0);
  EXPECT_EQ(std::memcmp(dw1.data(), dw2.data(), dw1.size() * 4), 0);
  for (int j = 0; j < V; ++j) ASSERT_EQ(dlogits[3 * V + j], 0.0f);  // a masked row: exact zeros
  // A frozen head: no dweight, the same dhidden bits.
  std::vector<float> dh3(dh2.size(), -7.0f);
  fb.dhidden = view(dh3, DType::f32, {T, H});
  fb.dweight = {};
  lm_head_logprob_backward(Context{}, fb);
  EXPECT_EQ(std::memcmp(dh1.data(), dh3.data(), dh1.size() * 4), 0) << "dhidden without dweight";
  // Given, dweight must still be the weight's fp32 accumulator.
  std::vector<float> dw_small(size_t(V - 1) * H);
  fb.dweight = view(dw_small, DType::f32, {V - 1, H});
  try {
    lm_head_logprob_backward(Context{}, fb);
    ADD_FAILURE() << "a dweight of the wrong shape was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "dweight") << e.what();
  }
}

// logits_kept (the LM head's three-GEMM mode) is checked on every backend: fp32 [C, V], C <= T, and
// in the backward C where a segment starts or ends; the CPU computes the same bits with or without it.
TEST(CpuOps, LmHeadKeptLogitsAreCheckedAndChangeNoBit) {
  const int T = 6, H = 8, V = 40;
  Rng r(61);
  auto hidden = random_floats(r, T * H, -1, 1), w = random_floats(r, V * H, -0.5, 0.5);
  std::vector<int32_t> tg{3, 39, -100, 20, 0, 10};
  std::vector<float> lp(T), lse(T), kept((T + 1) * V), lp_kept(T), dh(T * H), dh_kept(T * H), dw(V * H), dw_kept(V * H);
  std::vector<float> dlogp = random_floats(r, T, -1, 1);
  std::vector<int32_t> segs{0, 2, 2, 3, 5, 1};  // sequences of 2, 3 and 1 tokens
  auto forward = [&](std::vector<float>& logp, int kept_rows, DType kept_dtype) {
    LmHeadLogprobForwardArgs f;
    f.hidden = view(hidden, DType::f32, {T, H});
    f.weight = view(w, DType::f32, {V, H});
    f.targets = view(tg, DType::i32, {T});
    f.logp = view(logp, DType::f32, {T});
    f.lse = view(lse, DType::f32, {T});
    if (kept_rows >= 0) f.logits_kept = view(kept, kept_dtype, {kept_rows, V});
    lm_head_logprob_forward(Context{}, f);
  };
  auto backward = [&](std::vector<float>& dhidden, std::vector<float>& dweight, int kept_rows) {
    LmHeadLogprobBackwardArgs b;
    b.hidden = view(hidden, DType::f32, {T, H});
    b.weight = view(w, DType::f32, {V, H});
    b.targets = view(tg, DType::i32, {T});
    b.lse = view(lse, DType::f32, {T});
    b.dlogp = view(dlogp, DType::f32, {T});
    b.dhidden = view(dhidden, DType::f32, {T, H});
    b.dweight = view(dweight, DType::f32, {V, H});
    b.segments = view(segs, DType::i32, {3, 2});
    if (kept_rows >= 0) b.logits_kept = view(kept, DType::f32, {kept_rows, V});
    lm_head_logprob_backward(Context{}, b);
  };
  forward(lp, -1, DType::f32);
  backward(dh, dw, -1);
  for (const int c : {0, 2, 5, 6}) {  // segment edges
    std::fill(dw_kept.begin(), dw_kept.end(), 0.0f);
    forward(lp_kept, c, DType::f32);
    backward(dh_kept, dw_kept, c);
    EXPECT_EQ(std::memcmp(lp.data(), lp_kept.data(), T * 4), 0) << c;
    EXPECT_EQ(std::memcmp(dh.data(), dh_kept.data(), dh.size() * 4), 0) << c;
    EXPECT_EQ(std::memcmp(dw.data(), dw_kept.data(), dw.size() * 4), 0) << c;
  }
  auto fails = [](auto&& call, const char* words) {
    try {
      call();
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "logits_kept");
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "no error (" << words << ")";
  };
  fails([&] { backward(dh_kept, dw_kept, 3); }, "segment");  // inside the 3-token sequence
  fails([&] { forward(lp_kept, T + 1, DType::f32); }, "more than");
  fails([&] { forward(lp_kept, 2, DType::f64); }, "");
}

TEST(CpuOps, DecodeEqualsPrefillBitwise) {
  const int L = 23, Hq = 4, Hkv = 2, D = 32;
  Rng r(7);
  auto q = random_floats(r, L * Hq * D, -2, 2), k = random_floats(r, L * Hkv * D, -2, 2),
       v = random_floats(r, L * Hkv * D, -1, 1);
  std::vector<float> prefill(L * Hq * D), decode(L * Hq * D);
  AttentionForwardArgs a;
  a.q = view(q, DType::f32, {L, Hq, D});
  a.k = view(k, DType::f32, {L, Hkv, D});
  a.v = view(v, DType::f32, {L, Hkv, D});
  std::vector<int32_t> whole{0, L, 0, L};
  a.seqs = view(whole, DType::i32, {1, 4});
  a.out = view(prefill, DType::f32, {L, Hq, D});
  attention_forward(Context{}, a);
  for (int t = 0; t < L; ++t) {  // token t decoded against the cache of tokens 0..t
    std::vector<int32_t> step{0, 1, 0, t + 1};
    AttentionForwardArgs d = a;
    d.q = TensorView::of(&q[t * Hq * D], DType::f32, {1, Hq, D});
    d.out = TensorView::of(&decode[t * Hq * D], DType::f32, {1, Hq, D});
    d.seqs = view(step, DType::i32, {1, 4});
    attention_forward(Context{}, d);
  }
  EXPECT_EQ(std::memcmp(prefill.data(), decode.data(), prefill.size() * 4), 0);
}

TEST(CpuOps, PagedCacheEqualsContiguousBitwise) {
  // Two sequences' keys scattered over a pool of 4-row pages in shuffled order (junk in the rows no
  // sequence uses): the same bits as the keys laid out contiguously.
  const int Hq = 4, Hkv = 2, D = 16, P = 4, L0 = 9, L1 = 6, pool_pages = 7;
  Rng r(11);
  auto q = random_floats(r, (L0 + L1) * Hq * D, -2, 2), k = random_floats(r, (L0 + L1) * Hkv * D, -2, 2),
       v = random_floats(r, (L0 + L1) * Hkv * D, -1, 1);
  std::vector<float> contiguous((L0 + L1) * Hq * D), paged((L0 + L1) * Hq * D);
  AttentionForwardArgs a;
  a.q = view(q, DType::f32, {L0 + L1, Hq, D});
  a.k = view(k, DType::f32, {L0 + L1, Hkv, D});
  a.v = view(v, DType::f32, {L0 + L1, Hkv, D});
  std::vector<int32_t> seqs{0, L0, 0, L0, L0, L1, L0, L1};
  a.seqs = view(seqs, DType::i32, {2, 4});
  a.out = view(contiguous, DType::f32, {L0 + L1, Hq, D});
  attention_forward(Context{}, a);
  // Sequence 0 in pool pages 5, 1, 3; sequence 1 in pages 0, 6.
  std::vector<int32_t> table{5, 1, 3, 0, 6, 2};
  std::vector<float> pk(pool_pages * P * Hkv * D, 1e4f), pv(pk.size(), -1e4f);
  auto place = [&](int seq_row0, int len, const int32_t* pages) {
    for (int j = 0; j < len; ++j)
      for (int i = 0; i < Hkv * D; ++i) {
        const int64_t dst = (int64_t(pages[j / P]) * P + j % P) * Hkv * D + i, src = int64_t(seq_row0 + j) * Hkv * D + i;
        pk[dst] = k[src];
        pv[dst] = v[src];
      }
  };
  place(0, L0, &table[0]);
  place(L0, L1, &table[3]);
  std::vector<int32_t> paged_seqs{0, L0, 0, L0, L0, L1, 0, L1};
  AttentionForwardArgs b = a;
  b.k = view(pk, DType::f32, {pool_pages * P, Hkv, D});
  b.v = view(pv, DType::f32, {pool_pages * P, Hkv, D});
  b.seqs = view(paged_seqs, DType::i32, {2, 4});
  b.block_table = view(table, DType::i32, {2, 3});
  b.page_size = P;
  b.out = view(paged, DType::f32, {L0 + L1, Hq, D});
  attention_forward(Context{}, b);
  EXPECT_EQ(std::memcmp(contiguous.data(), paged.data(), paged.size() * 4), 0);
}

TEST(CpuOps, UncoveredQueryRowsAreZeroWithMinusInfinityLse) {
  const int T = 5, H = 1, D = 4;
  std::vector<float> q(T * H * D, 0.5f), out(T * H * D, 9.0f), lse(T * H, 9.0f);
  std::vector<int32_t> seqs{1, 2, 1, 2};  // rows 0, 3, 4 belong to no sequence
  AttentionForwardArgs a;
  a.q = a.k = a.v = view(q, DType::f32, {T, H, D});
  a.out = view(out, DType::f32, {T, H, D});
  a.lse = view(lse, DType::f32, {T, H});
  a.seqs = view(seqs, DType::i32, {1, 4});
  attention_forward(Context{}, a);
  for (int row : {0, 3, 4}) {
    EXPECT_EQ(lse[row], -std::numeric_limits<float>::infinity());
    for (int d = 0; d < D; ++d) EXPECT_EQ(out[row * D + d], 0.0f);
  }
  EXPECT_FLOAT_EQ(out[1 * D], 0.5f);
}

TEST(CpuOps, WeightGradientsChainAcrossMicroBatchesBitwise) {
  // dW over 10 tokens in one call == 3 + 7 tokens in two calls into the same accumulator.
  const int M = 10, N = 6, K = 20;
  Rng r(8);
  auto dy = random_floats(r, M * N, -1, 1), x = random_floats(r, M * K, -1, 1);
  std::vector<float> one(N * K, 0.125f), two(N * K, 0.125f);
  LinearBackwardWeightArgs a;
  a.dy = view(dy, DType::f32, {M, N});
  a.x = view(x, DType::f32, {M, K});
  a.dweight = view(one, DType::f32, {N, K});
  linear_backward_weight(Context{}, a);
  for (auto [begin, end] : {std::pair<int, int>{0, 3}, {3, 10}}) {
    LinearBackwardWeightArgs b;
    b.dy = a.dy.rows(begin, end);
    b.x = a.x.rows(begin, end);
    b.dweight = view(two, DType::f32, {N, K});
    linear_backward_weight(Context{}, b);
  }
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * 4), 0);
}

// int64 ids (torch's index type) are read as they are and give the int32 ids' bits, forward and
// backward (with masked rows and repeated ids).
TEST(CpuOps, EmbeddingTakesInt64IdsWithTheInt32Bits) {
  const int64_t T = 9, V = 6, H = 5;
  Rng r(7);
  std::vector<float> table = random_floats(r, V * H, -1, 1), dy = random_floats(r, T * H, -1, 1);
  std::vector<int32_t> ids32{0, 5, 2, 2, 3, 5, 1, 0, 4};
  std::vector<int64_t> ids64(ids32.begin(), ids32.end());
  std::vector<uint8_t> mask{1, 1, 0, 1, 1, 1, 0, 1, 1};
  std::vector<float> y32(T * H), y64(T * H), g32(V * H, 0.25f), g64(V * H, 0.25f);
  embedding_forward(Context{}, {view(ids32, DType::i32, {T}), view(table, DType::f32, {V, H}), view(y32, DType::f32, {T, H})});
  embedding_forward(Context{}, {view(ids64, DType::i64, {T}), view(table, DType::f32, {V, H}), view(y64, DType::f32, {T, H})});
  EXPECT_EQ(std::memcmp(y32.data(), y64.data(), y32.size() * sizeof(float)), 0);
  embedding_backward(Context{}, {view(ids32, DType::i32, {T}), view(dy, DType::f32, {T, H}), view(mask, DType::u8, {T}),
                                 view(g32, DType::f32, {V, H})});
  embedding_backward(Context{}, {view(ids64, DType::i64, {T}), view(dy, DType::f32, {T, H}), view(mask, DType::u8, {T}),
                                 view(g64, DType::f32, {V, H})});
  EXPECT_EQ(std::memcmp(g32.data(), g64.data(), g32.size() * sizeof(float)), 0);
  EXPECT_NE(g32[2 * H], 0.25f);  // row 2 took its one unmasked token's gradient
}

// CUDA RMSNorm (+ fused residual add), QK-norm, RoPE, SwiGLU and the residual add (runs where a GPU
// is visible; skipped elsewhere). Raw bits of a row against the batch around it, its offset and the
// alignment of the buffer (16-byte vector loads against element-by-element ones); the fused add =
// add then norm; a recomputed rstd = the saved one; dweight over micro-batches split at sequence
// boundaries, packed or padded = one call; RoPE of a position the same in every slot and in decode;
// accuracy against fp64 at model sizes (the harness sweeps the small ones: samebits verify).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "ops/tuning.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "samebits/ops.hpp"
#include "tests/cuda/cuda_test_util.hpp"

namespace {

class CudaNormRope : public testing_cuda::CudaTest {
 protected:
  void TearDown() override { detail::norm_any_dtype_path_override() = false; }  // even after a failure
};

HostTensor rmsnorm_y(const HostTensor& x, const HostTensor& w, int64_t shift) {
  const ShiftedBuffer dx(x, shift), dw(w, shift);
  ShiftedBuffer y(HostTensor(x.dtype(), x.shape()), shift);
  RmsNormForwardArgs a;
  a.x = dx.view();
  a.weight = dw.view();
  a.y = y.view();
  rmsnorm_forward(cuda_ctx(), a);
  return y.host();
}

struct FusedOut {
  HostTensor y, sum;
};

// The fused residual add + RMSNorm's arguments: y = norm(s), s = x + res into sum.
RmsNormForwardArgs fused_args(const DeviceBuffer& x, const DeviceBuffer& res, const DeviceBuffer& w,
                              const DeviceBuffer& y, const DeviceBuffer& sum) {
  RmsNormForwardArgs a;
  a.x = x.view();
  a.residual = res.view();
  a.weight = w.view();
  a.y = y.view();
  a.residual_out = sum.view();
  return a;
}

// The fused residual add + RMSNorm of x and res (s in res_out_dt).
FusedOut fused_add_norm(const HostTensor& x, const HostTensor& res, const HostTensor& w, DType res_out_dt) {
  const DeviceBuffer dx(x), dres(res), dw(w), y(x.dtype(), x.shape()), sum(res_out_dt, x.shape());
  rmsnorm_forward(cuda_ctx(), fused_args(dx, dres, dw, y, sum));
  return {y.host(), sum.host()};
}

}  // namespace

// Each row's y is the same bits whatever batch it is normalised in, at any offset, and whether the
// buffers are 16-byte aligned (vector loads) or not (element by element); also at odd H (tails).
TEST_F(CudaNormRope, RmsNormRowBitsIgnoreBatchOffsetAndAlignment) {
  for (const auto& [dt, H] : {std::pair<DType, int64_t>{DType::bf16, 4096}, {DType::bf16, 8192}, {DType::f16, 4097},
                              {DType::f32, 96}, {DType::bf16, 5000}}) {
    Rng r(7 + H);
    const HostTensor x = r.tensor(dt, {37, H}, -3, 3), w = r.tensor(dt, {H}, 0.5, 1.5);
    const HostTensor whole = rmsnorm_y(x, w, 0);
    expect_same_bits(rmsnorm_y(x, w, 1), whole, "unaligned buffers, H=" + std::to_string(H));
    for (const auto& [off, m] : {std::pair<int64_t, int64_t>{0, 1}, {5, 1}, {36, 1}, {3, 7}, {10, 27}}) {
      const HostTensor part = rmsnorm_y(x.slice_rows(off, off + m), w, 0);
      expect_same_bits(part, whole.slice_rows(off, off + m),
                       "rows " + std::to_string(off) + "+" + std::to_string(m) + ", H=" + std::to_string(H));
    }
  }
}

// The fused residual add is residual_add_forward then rmsnorm_forward, bit for bit (s is rounded to
// residual_out's dtype and the norm reads the rounded s); also with an fp32 residual stream.
TEST_F(CudaNormRope, FusedAddNormEqualsAddThenNorm) {
  for (DType res_dt : {DType::bf16, DType::f32}) {
    Rng r(11);
    const int64_t T = 19, H = 4096;
    const DeviceBuffer x(r.tensor(DType::bf16, {T, H}, -2, 2)), res(r.tensor(res_dt, {T, H}, -2, 2)),
        w(r.tensor(DType::f32, {H}, 0.5, 1.5));
    const DeviceBuffer y1(DType::bf16, {T, H}), s1(res_dt, {T, H}), y2(DType::bf16, {T, H}), s2(res_dt, {T, H}),
        rstd1(DType::f32, {T}), rstd2(DType::f32, {T});
    RmsNormForwardArgs f = fused_args(x, res, w, y1, s1);
    f.rstd = rstd1.view();
    rmsnorm_forward(cuda_ctx(), f);
    ResidualAddArgs add;
    add.a = x.view();
    add.b = res.view();
    add.y = s2.view();
    residual_add_forward(cuda_ctx(), add);
    RmsNormForwardArgs n;
    n.x = s2.view();
    n.weight = w.view();
    n.y = y2.view();
    n.rstd = rstd2.view();
    rmsnorm_forward(cuda_ctx(), n);
    expect_same_bits(s1.host(), s2.host(), "residual_out");
    expect_same_bits(y1.host(), y2.host(), "y");
    expect_same_bits(rstd1.host(), rstd2.host(), "rstd");
  }
}

namespace {

struct NormGrads {
  HostTensor dx, dweight;
};

// rmsnorm_backward over rows [off, off + m) of x / dy with the given segments (relative to the call),
// dweight accumulating into `dweight`.
NormGrads norm_backward(const HostTensor& x, const HostTensor& dy, const HostTensor& w, const HostTensor& mask,
                        int64_t off, int64_t m, const std::vector<int32_t>& segs, const HostTensor& dweight_in,
                        bool saved_rstd, bool qk, int64_t heads = 1) {
  const HostTensor xs = x.slice_rows(off, off + m), dys = dy.slice_rows(off, off + m), ms = mask.slice_rows(off, off + m);
  const DeviceBuffer dx_(xs), dy_(dys), w_(w), mask_(ms), dw(dweight_in), dx(xs.dtype(), xs.shape());
  const DeviceBuffer rstd(DType::f32, qk ? std::vector<int64_t>{m, heads} : std::vector<int64_t>{m});
  HostTensor seg(DType::i32, {int64_t(segs.size() / 2), 2});
  if (!segs.empty()) std::memcpy(seg.data(), segs.data(), segs.size() * sizeof(int32_t));
  const DeviceBuffer y(xs.dtype(), xs.shape());
  // The two norms' argument structs share their field names: one filling for both.
  auto run = [&](auto f, auto b, auto forward, auto backward) {
    f.x = dx_.view();
    f.weight = w_.view();
    f.y = y.view();
    f.rstd = rstd.view();
    forward(cuda_ctx(), f);
    b.dy = dy_.view();
    b.x = dx_.view();
    b.weight = w_.view();
    if (saved_rstd) b.rstd = rstd.view();
    b.row_mask = mask_.view();
    b.dx = dx.view();
    b.dweight = dw.view();
    if (!segs.empty()) b.segments = seg.view();
    backward(cuda_ctx(), b);
  };
  if (qk) run(QkNormForwardArgs{}, QkNormBackwardArgs{}, qk_norm_forward, qk_norm_backward);
  else run(RmsNormForwardArgs{}, RmsNormBackwardArgs{}, rmsnorm_forward, rmsnorm_backward);
  return {dx.host(), dw.host()};
}

}  // namespace

// The compile-time-bf16 instance (every row tensor bf16) and the run-time-dtype one give the same
// bits, forward (plain and fused with the residual add) and backward (saved and recomputed rstd, two
// rows a step against one), at H = 4096 and 8192 (two vectors a thread). T is large enough that
// every forward CTA takes several rows, so the next row's prefetch is exercised too.
TEST_F(CudaNormRope, Bf16InstanceEqualsRunTimeDtypeInstance) {
  Rng r(17);
  for (const int64_t H : {int64_t(4096), int64_t(8192)}) {
    const int64_t T = H == 4096 ? 2501 : 1203;
    const HostTensor x = r.tensor(DType::bf16, {T, H}, -2, 2), dy = r.tensor(DType::bf16, {T, H}, -1, 1),
                     res = r.tensor(DType::bf16, {T, H}, -1, 1), w = r.tensor(DType::bf16, {H}, 0.5, 1.5),
                     dw0 = r.tensor(DType::f32, {H}, -1, 1);
    HostTensor mask(DType::u8, {T});
    for (int64_t t = 0; t < T; ++t) mask.set(t, t % 9 == 0 ? 0 : 1);
    std::vector<HostTensor> got;
    for (bool any_dtype : {false, true}) {
      detail::norm_any_dtype_path_override() = any_dtype;
      got.push_back(rmsnorm_y(x, w, 0));
      const FusedOut f = fused_add_norm(x, res, w, DType::bf16);
      got.push_back(f.y);
      got.push_back(f.sum);
      for (bool saved : {false, true}) {
        const NormGrads g = norm_backward(x, dy, w, mask, 0, T, {}, dw0, saved, false);
        got.push_back(g.dx);
        got.push_back(g.dweight);
      }
    }
    const size_t n = got.size() / 2;
    for (size_t k = 0; k < n; ++k)
      expect_same_bits(got[n + k], got[k], "H " + std::to_string(H) + " output " + std::to_string(k));
  }
}

// dweight over micro-batches split at sequence boundaries (each call with its own segments, all
// accumulating into one non-zero buffer), and over a padded layout of the same sequences (padding
// rows outside every segment), equals one packed call bit for bit; dx rows too; a recomputed rstd
// gives the saved one's bits. RMSNorm at H = 4096 (chunks of 64 rows) and 8192, QK-norm at D = 128.
TEST_F(CudaNormRope, WeightGradientSplitsAndPaddingKeepBits) {
  struct Shape {
    bool qk;
    int64_t heads, H;
  };
  for (const Shape s : {Shape{false, 1, 4096}, Shape{false, 1, 8192}, Shape{true, 8, 128}}) {
    Rng r(23 + s.H);
    const std::vector<int64_t> lens = {37, 100, 1, 90, 72};
    int64_t T = 0;
    for (auto l : lens) T += l;
    const std::vector<int64_t> shape = s.qk ? std::vector<int64_t>{T, s.heads, s.H} : std::vector<int64_t>{T, s.H};
    const HostTensor x = r.tensor(DType::bf16, shape, -2, 2), dy = r.tensor(DType::bf16, shape, -1, 1);
    const HostTensor w = r.tensor(DType::bf16, {s.H}, 0.5, 1.5), dw0 = r.tensor(DType::f32, {s.H}, -1, 1);
    HostTensor mask(DType::u8, {T});
    for (int64_t t = 0; t < T; ++t) mask.set(t, r.uniform(0, 1) < 0.1 ? 0 : 1);
    std::vector<int32_t> all;
    int64_t row = 0;
    for (auto l : lens) {
      all.push_back(int32_t(row));
      all.push_back(int32_t(l));
      row += l;
    }
    const std::string what = s.qk ? "qk_norm" : "rmsnorm H=" + std::to_string(s.H);
    const NormGrads one = norm_backward(x, dy, w, mask, 0, T, all, dw0, true, s.qk, s.heads);
    const NormGrads recomputed = norm_backward(x, dy, w, mask, 0, T, all, dw0, false, s.qk, s.heads);
    expect_same_bits(recomputed.dx, one.dx, what + ": dx with a recomputed rstd");
    expect_same_bits(recomputed.dweight, one.dweight, what + ": dweight with a recomputed rstd");
    // micro-batches {seq 0, 1}, {seq 2}, {seq 3, 4}
    HostTensor dw = dw0;
    std::vector<HostTensor> dx_parts;
    for (const auto& [first, count] : {std::pair<int, int>{0, 2}, {2, 1}, {3, 2}}) {
      int64_t off = 0, m = 0;
      for (int i = 0; i < first; ++i) off += lens[i];
      std::vector<int32_t> segs;
      for (int i = first; i < first + count; ++i) {
        segs.push_back(int32_t(m));
        segs.push_back(int32_t(lens[i]));
        m += lens[i];
      }
      const NormGrads g = norm_backward(x, dy, w, mask, off, m, segs, dw, true, s.qk, s.heads);
      dw = g.dweight;
      expect_same_bits(g.dx, one.dx.slice_rows(off, off + m), what + ": dx of a micro-batch");
    }
    expect_same_bits(dw, one.dweight, what + ": dweight over three micro-batches");
    // padded: 5 padding rows before each sequence, masked
    const int64_t pad = 5, Tp = T + pad * int64_t(lens.size());
    std::vector<int64_t> pshape = shape;
    pshape[0] = Tp;
    HostTensor xp(DType::bf16, pshape), dyp(DType::bf16, pshape), maskp(DType::u8, {Tp});
    std::vector<int32_t> psegs;
    int64_t src = 0, dst = 0;
    for (auto l : lens) {
      dst += pad;
      xp.copy_rows_from(x, src, dst, l);
      dyp.copy_rows_from(dy, src, dst, l);
      maskp.copy_rows_from(mask, src, dst, l);
      psegs.push_back(int32_t(dst));
      psegs.push_back(int32_t(l));
      src += l;
      dst += l;
    }
    const NormGrads padded = norm_backward(xp, dyp, w, maskp, 0, Tp, psegs, dw0, true, s.qk, s.heads);
    expect_same_bits(padded.dweight, one.dweight, what + ": dweight of the padded layout");
  }
}

// Against fp64 at a model's size, fp32 in and out: y within 2e-6 relative (a 4096-term fp32 sum of
// squares, a square root, a division and two products), dx and dweight within 4e-6 of the
// magnitude of their terms.
TEST_F(CudaNormRope, RmsNormAccurateAgainstFp64) {
  Rng r(31);
  const int64_t T = 64, H = 4096;
  const HostTensor x = r.tensor(DType::f32, {T, H}, -3, 3), dy = r.tensor(DType::f32, {T, H}, -1, 1),
                   w = r.tensor(DType::f32, {H}, 0.5, 1.5), dw0(DType::f32, {H});
  HostTensor mask(DType::u8, {T});
  for (int64_t t = 0; t < T; ++t) mask.set(t, 1);
  const NormGrads g = norm_backward(x, dy, w, mask, 0, T, {}, dw0, false, false);
  const HostTensor y = rmsnorm_y(x, w, 0);
  double worst_y = 0, worst_dx = 0, worst_dw = 0;
  std::vector<double> dw_ref(H, 0.0), dw_mag(H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += x.get(t * H + i) * x.get(t * H + i);
    const double rstd = 1.0 / std::sqrt(ss / H + 1e-6);
    double dot = 0, dot_mag = 0;
    for (int64_t i = 0; i < H; ++i) {
      const double gi = dy.get(t * H + i) * w.get(i), xh = x.get(t * H + i) * rstd;
      dot += gi * xh;
      dot_mag += std::fabs(gi * xh);
      dw_ref[i] += dy.get(t * H + i) * xh;
      dw_mag[i] += std::fabs(dy.get(t * H + i) * xh);
      const double yr = xh * w.get(i);
      worst_y = std::max(worst_y, std::fabs(y.get(t * H + i) - yr) / (2e-6 * std::fabs(yr) + 1e-7));
    }
    for (int64_t i = 0; i < H; ++i) {
      const double gi = dy.get(t * H + i) * w.get(i), xh = x.get(t * H + i) * rstd;
      const double want = rstd * (gi - xh * dot / H);
      const double tol = 4e-6 * rstd * (std::fabs(gi) + std::fabs(xh) * dot_mag / H) + 1e-7;
      worst_dx = std::max(worst_dx, std::fabs(g.dx.get(t * H + i) - want) / tol);
    }
  }
  for (int64_t i = 0; i < H; ++i)
    worst_dw = std::max(worst_dw, std::fabs(g.dweight.get(i) - dw_ref[i]) / (4e-6 * dw_mag[i] + 1e-7));
  std::printf("ACCURACY rmsnorm fp32 H=4096: worst error / tolerance: y %.3g, dx %.3g, dweight %.3g\n", worst_y,
              worst_dx, worst_dw);
  EXPECT_LE(worst_y, 1.0);
  EXPECT_LE(worst_dx, 1.0);
  EXPECT_LE(worst_dw, 1.0);
}

namespace {

HostTensor rope(const HostTensor& x, const std::vector<int32_t>& pos, const RopeConfig& c, bool inverse,
                int64_t shift = 0) {
  HostTensor p(DType::i32, {int64_t(pos.size())});
  for (size_t i = 0; i < pos.size(); ++i) p.set(int64_t(i), pos[i]);
  const ShiftedBuffer dx(x, shift), y(HostTensor(x.dtype(), x.shape()), shift);
  const DeviceBuffer dp(p);
  RopeArgs a;
  a.x = dx.view();
  a.positions = dp.view();
  a.y = y.view();
  a.config = c;
  if (inverse) rope_backward(cuda_ctx(), a);
  else rope_forward(cuda_ctx(), a);
  return y.host();
}

}  // namespace

// A token's rotation depends on its position and its own values only: the same bits alone (decode),
// in any slot of a batch (packed sequences restarting at 0, chunked-prefill offsets), unaligned; the
// backward undoes the forward to fp32 rounding; Llama-3 scaling and a position near 2^20.
TEST_F(CudaNormRope, RopePositionGivesTheSameBitsEverywhere) {
  RopeConfig llama;
  llama.theta = 500000.0;
  llama.llama3_scaling = true;
  for (const auto& [cfg, D, heads] : {std::tuple<RopeConfig, int64_t, int64_t>{RopeConfig{}, 128, 8},
                                      {llama, 128, 4}, {RopeConfig{}, 64, 3}, {RopeConfig{}, 36, 2}}) {
    Rng r(41 + D);
    const int64_t T = 40;
    const HostTensor x = r.tensor(DType::bf16, {T, heads, D}, -2, 2);
    std::vector<int32_t> pos(T);
    for (int64_t t = 0; t < T; ++t) pos[t] = int32_t(t < 20 ? t : t < 30 ? t - 20 : 1000000 + 7 * t);
    const HostTensor y = rope(x, pos, cfg, false);
    expect_same_bits(rope(x, pos, cfg, false, 1), y, "unaligned, D=" + std::to_string(D));
    for (int64_t t : {0, 5, 19, 20, 29, 39}) {
      const HostTensor alone = rope(x.slice_rows(t, t + 1), {pos[t]}, cfg, false);
      expect_same_bits(alone, y.slice_rows(t, t + 1), "token " + std::to_string(t) + " alone, D=" + std::to_string(D));
    }
    // The same token values at another slot with the same position: same bits.
    HostTensor x2 = x;
    x2.copy_rows_from(x, 3, 25, 1);
    std::vector<int32_t> pos2 = pos;
    pos2[25] = pos[3];
    expect_same_bits(rope(x2, pos2, cfg, false).slice_rows(25, 26), y.slice_rows(3, 4), "slot 25 = slot 3");
    const HostTensor xf = x.converted(DType::f32);
    const HostTensor back = rope(rope(xf, pos, cfg, false), pos, cfg, true);
    double worst = 0;
    for (int64_t i = 0; i < xf.numel(); ++i) worst = std::max(worst, std::fabs(back.get(i) - xf.get(i)));
    EXPECT_LE(worst, 4e-6) << "backward(forward(x)) - x, D=" << D;
  }
}

// QK-norm fused with RoPE gives the bits of its definition: forward = qk_norm_forward into y, then
// rope_forward in place on y; backward = rope_backward of dy into an fp32 tensor, then
// qk_norm_backward on it (dx, and dweight over a mask and two segments), rstd saved and recomputed.
// Qwen3-8B's q and k heads at D = 128, D = 64, D = 96 (the pair partner 6 lanes away, not a
// power of two) and D = 16 (one lane a half); positions restarting, and far out.
TEST_F(CudaNormRope, QkNormPairGivesEachPartItsOwnCallsBits) {
  // q and k in one launch (qk_norm_pair_forward): each part's y and rstd bitwise its own
  // qk_norm_forward's, with and without fused RoPE, q and k of different head counts, T from a
  // decode's 1 to a prefill's 333, bf16 and fp16 (the generic instance).
  struct Shape {
    DType dt;
    int64_t T, q_heads, k_heads, D;
  };
  for (const Shape& s : {Shape{DType::bf16, 1, 32, 8, 128}, Shape{DType::bf16, 3, 32, 8, 128},
                         Shape{DType::bf16, 333, 32, 8, 128}, Shape{DType::f16, 64, 16, 8, 64},
                         Shape{DType::bf16, 17, 5, 3, 96}})
    for (const bool rope : {false, true}) {
      if (rope && s.D % 16 != 0) continue;
      const std::string what = std::string(dtype_name(s.dt)) + " T=" + std::to_string(s.T) + " D=" +
                               std::to_string(s.D) + (rope ? " rope" : "");
      Rng r(71 + s.T + s.D);
      const HostTensor xq = r.tensor(s.dt, {s.T, s.q_heads, s.D}, -2, 2), xk = r.tensor(s.dt, {s.T, s.k_heads, s.D}, -2, 2),
                       wq = r.tensor(s.dt, {s.D}, 0.5, 1.5), wk = r.tensor(s.dt, {s.D}, 0.5, 1.5);
      HostTensor pos(DType::i32, {s.T});
      for (int64_t t = 0; t < s.T; ++t) pos.set(t, double(5 * t + 3));
      const DeviceBuffer d_xq(xq), d_xk(xk), d_wq(wq), d_wk(wk), d_pos(pos);
      const DeviceBuffer yq(s.dt, {s.T, s.q_heads, s.D}), yk(s.dt, {s.T, s.k_heads, s.D}),
          rq(DType::f32, {s.T, s.q_heads}), rk(DType::f32, {s.T, s.k_heads}), yq_ref(s.dt, {s.T, s.q_heads, s.D}),
          yk_ref(s.dt, {s.T, s.k_heads, s.D}), rq_ref(DType::f32, {s.T, s.q_heads}), rk_ref(DType::f32, {s.T, s.k_heads});
      QkNormPairForwardArgs pair;
      pair.q = {d_xq.view(), d_wq.view(), yq.view(), rq.view()};
      pair.k = {d_xk.view(), d_wk.view(), yk.view(), rk.view()};
      if (rope) pair.positions = d_pos.view();
      qk_norm_pair_forward(cuda_ctx(), pair);
      for (const auto& [x, w, y, rs] : {std::tuple{&d_xq, &d_wq, &yq_ref, &rq_ref}, std::tuple{&d_xk, &d_wk, &yk_ref, &rk_ref}}) {
        QkNormForwardArgs f;
        f.x = x->view();
        f.weight = w->view();
        f.y = y->view();
        f.rstd = rs->view();
        if (rope) f.positions = d_pos.view();
        qk_norm_forward(cuda_ctx(), f);
      }
      expect_same_bits(yq.host(), yq_ref.host(), what + ": q");
      expect_same_bits(yk.host(), yk_ref.host(), what + ": k");
      expect_same_bits(rq.host(), rq_ref.host(), what + ": q rstd");
      expect_same_bits(rk.host(), rk_ref.host(), what + ": k rstd");
    }
}

TEST_F(CudaNormRope, QkNormPairWritesTheCacheRows) {
  // The pair's cache write (a decode step's paged KV cache, fused into the launch): q.y, k.y and the
  // rstds bitwise the pair's without it; each token's k.y row (the rounded, rotated values) and v row
  // (verbatim) in its cache row, a -1 token writing nothing, every other cache row as it was. bf16
  // (the all-bf16 instance), fp16 and fp32 (the generic one), D = 20 (vectors cut short: the element
  // by element paths), a decode's T = 1 to a prefill's 333.
  struct Shape {
    DType dt;
    int64_t T, q_heads, k_heads, D;
  };
  for (const Shape& s : {Shape{DType::bf16, 1, 32, 8, 128}, Shape{DType::bf16, 5, 32, 8, 128},
                         Shape{DType::bf16, 333, 32, 8, 128}, Shape{DType::f16, 64, 16, 8, 64},
                         Shape{DType::f32, 9, 4, 2, 64}, Shape{DType::bf16, 17, 5, 3, 96},
                         Shape{DType::bf16, 7, 3, 2, 20}})
    for (const bool rope : {false, true}) {
      if (rope && s.D % 16 != 0) continue;
      const std::string what = std::string(dtype_name(s.dt)) + " T=" + std::to_string(s.T) + " D=" +
                               std::to_string(s.D) + (rope ? " rope" : "");
      Rng r(97 + s.T + s.D);
      const int64_t R = 2 * s.T + 3;  // cache rows
      const HostTensor xq = r.tensor(s.dt, {s.T, s.q_heads, s.D}, -2, 2), xk = r.tensor(s.dt, {s.T, s.k_heads, s.D}, -2, 2),
                       v = r.tensor(s.dt, {s.T, s.k_heads, s.D}, -2, 2), wq = r.tensor(s.dt, {s.D}, 0.5, 1.5),
                       wk = r.tensor(s.dt, {s.D}, 0.5, 1.5), kc0 = r.tensor(s.dt, {R, s.k_heads, s.D}, -9, 9),
                       vc0 = r.tensor(s.dt, {R, s.k_heads, s.D}, -9, 9);
      HostTensor pos(DType::i32, {s.T}), rows(DType::i32, {s.T});
      for (int64_t t = 0; t < s.T; ++t) {
        pos.set(t, double(5 * t + 3));
        rows.set(t, t % 5 == 2 ? -1.0 : double(R - 1 - 2 * t));  // backwards, every other row; some none
      }
      const DeviceBuffer d_xq(xq), d_xk(xk), d_v(v), d_wq(wq), d_wk(wk), d_pos(pos), d_rows(rows), kc(kc0), vc(vc0);
      const DeviceBuffer yq(s.dt, {s.T, s.q_heads, s.D}), yk(s.dt, {s.T, s.k_heads, s.D}),
          rq(DType::f32, {s.T, s.q_heads}), rk(DType::f32, {s.T, s.k_heads}), yq_ref(s.dt, {s.T, s.q_heads, s.D}),
          yk_ref(s.dt, {s.T, s.k_heads, s.D}), rq_ref(DType::f32, {s.T, s.q_heads}), rk_ref(DType::f32, {s.T, s.k_heads});
      QkNormPairForwardArgs pair;
      pair.q = {d_xq.view(), d_wq.view(), yq_ref.view(), rq_ref.view()};
      pair.k = {d_xk.view(), d_wk.view(), yk_ref.view(), rk_ref.view()};
      if (rope) pair.positions = d_pos.view();
      qk_norm_pair_forward(cuda_ctx(), pair);
      pair.q.y = yq.view(), pair.q.rstd = rq.view(), pair.k.y = yk.view(), pair.k.rstd = rk.view();
      pair.cache_rows = d_rows.view();
      pair.k_cache = kc.view();
      pair.v_cache = vc.view();
      pair.v = d_v.view();
      qk_norm_pair_forward(cuda_ctx(), pair);
      const HostTensor yk_host = yk.host();
      expect_same_bits(yq.host(), yq_ref.host(), what + ": q");
      expect_same_bits(yk_host, yk_ref.host(), what + ": k");
      expect_same_bits(rq.host(), rq_ref.host(), what + ": q rstd");
      expect_same_bits(rk.host(), rk_ref.host(), what + ": k rstd");
      HostTensor want_k = kc0, want_v = vc0;
      for (int64_t t = 0; t < s.T; ++t) {
        const auto row = int64_t(rows.get(t));
        if (row < 0) continue;
        want_k.copy_rows_from(yk_host, t, row, 1);
        want_v.copy_rows_from(v, t, row, 1);
      }
      expect_same_bits(kc.host(), want_k, what + ": k cache");
      expect_same_bits(vc.host(), want_v, what + ": v cache");
    }
}

TEST_F(CudaNormRope, QkNormRopeEqualsQkNormThenRope) {
  RopeConfig llama;
  llama.theta = 500000.0;
  llama.llama3_scaling = true;
  struct Shape {
    DType dt;
    int64_t T, heads, D;
    RopeConfig cfg;
  };
  for (const Shape& s : {Shape{DType::bf16, 301, 32, 128, RopeConfig{}}, Shape{DType::bf16, 301, 8, 128, llama},
                         Shape{DType::f16, 77, 3, 64, RopeConfig{}}, Shape{DType::f32, 50, 5, 96, RopeConfig{}},
                         Shape{DType::bf16, 40, 4, 16, RopeConfig{}}}) {
    const std::string what = std::string(dtype_name(s.dt)) + " heads=" + std::to_string(s.heads) + " D=" + std::to_string(s.D);
    Rng r(61 + s.D + s.heads);
    const std::vector<int64_t> shape{s.T, s.heads, s.D};
    const HostTensor x = r.tensor(s.dt, shape, -2, 2), dy = r.tensor(s.dt, shape, -1, 1),
                     w = r.tensor(s.dt, {s.D}, 0.5, 1.5), dw0 = r.tensor(DType::f32, {s.D}, -1, 1);
    HostTensor pos(DType::i32, {s.T}), mask(DType::u8, {s.T}), seg(DType::i32, {2, 2});
    const int64_t half_T = s.T / 2;
    for (int64_t t = 0; t < s.T; ++t) {
      pos.set(t, double(t < half_T ? t : t < 3 * s.T / 4 ? t - half_T : 90000 + 3 * t));
      mask.set(t, t % 7 == 0 ? 0 : 1);
    }
    for (const auto& [i, v] : {std::pair<int64_t, int64_t>{0, 0}, {1, half_T}, {2, half_T}, {3, s.T - half_T}}) seg.set(i, double(v));
    const DeviceBuffer d_x(x), d_dy(dy), d_w(w), d_pos(pos), d_mask(mask);
    const DeviceBuffer y_ref(s.dt, shape), y_fused(s.dt, shape), rstd_ref(DType::f32, {s.T, s.heads}),
        rstd_fused(DType::f32, {s.T, s.heads});
    QkNormForwardArgs f;
    f.x = d_x.view();
    f.weight = d_w.view();
    f.y = y_ref.view();
    f.rstd = rstd_ref.view();
    qk_norm_forward(cuda_ctx(), f);
    rope_forward(cuda_ctx(), {y_ref.view(), d_pos.view(), y_ref.view(), s.cfg});
    f.y = y_fused.view();
    f.rstd = rstd_fused.view();
    f.positions = d_pos.view();
    f.rope = s.cfg;
    qk_norm_forward(cuda_ctx(), f);
    expect_same_bits(y_fused.host(), y_ref.host(), what + ": y");
    expect_same_bits(rstd_fused.host(), rstd_ref.host(), what + ": rstd");
    for (const bool saved_rstd : {true, false}) {
      const DeviceBuffer rotated(DType::f32, shape), dx_ref(s.dt, shape), dx_fused(s.dt, shape), dw_ref(dw0), dw_fused(dw0);
      rope_backward(cuda_ctx(), {d_dy.view(), d_pos.view(), rotated.view(), s.cfg});
      QkNormBackwardArgs b;
      b.dy = rotated.view();
      b.x = d_x.view();
      b.weight = d_w.view();
      if (saved_rstd) b.rstd = rstd_ref.view();
      b.row_mask = d_mask.view();
      b.dx = dx_ref.view();
      b.dweight = dw_ref.view();
      b.segments = seg.view();
      qk_norm_backward(cuda_ctx(), b);
      b.dy = d_dy.view();
      b.dx = dx_fused.view();
      b.dweight = dw_fused.view();
      b.positions = d_pos.view();
      b.rope = s.cfg;
      qk_norm_backward(cuda_ctx(), b);
      const std::string how = saved_rstd ? " (saved rstd)" : " (recomputed rstd)";
      expect_same_bits(dx_fused.host(), dx_ref.host(), what + ": dx" + how);
      expect_same_bits(dw_fused.host(), dw_ref.host(), what + ": dweight" + how);
    }
  }
  // A half of a row that is not whole 8-element vectors: a clear error, not a wrong answer.
  const HostTensor x(DType::bf16, {4, 2, 40}), w(DType::bf16, {40});
  HostTensor pos(DType::i32, {4});
  const DeviceBuffer d_x(x), d_w(w), d_y(x), d_pos(pos);
  QkNormForwardArgs f;
  f.x = d_x.view();
  f.weight = d_w.view();
  f.y = d_y.view();
  f.positions = d_pos.view();
  try {
    qk_norm_forward(cuda_ctx(), f);
    FAIL() << "head_dim 40 fused with RoPE should be unsupported on CUDA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
  }
}

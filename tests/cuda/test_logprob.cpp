// CUDA selected logprob (runs where a GPU is visible; skipped elsewhere): raw-bit invariance of
// logp / entropy / lse and dlogits across batch sizes, offsets and neighbours for the vocab sizes of
// Qwen3, Llama-3, a 32000 vocab and odd ones; repeats; accuracy against fp64; NaN rows; bad targets.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "samebits/ops.hpp"
#include "tests/cuda/cuda_test_util.hpp"

namespace {

constexpr int32_t IGNORE = -100;

// A batch of `rows` token rows: logits ~ 3·N(0, 1) (one row in eight peaked on its target), ~10%
// ignore_index targets, ~15% masked, upstream gradients in [-1, 1].
struct Batch {
  HostTensor logits, targets, mask, dlogp, dentropy;
  Batch(Rng& r, DType dt, int64_t rows, int64_t V) : logits(dt, {rows, V}), targets(DType::i32, {rows}),
      mask(DType::u8, {rows}), dlogp(r.tensor(DType::f32, {rows}, -1, 1)), dentropy(r.tensor(DType::f32, {rows}, -1, 1)) {
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t tg = r.integer(0, V - 1);
      targets.set(t, r.uniform(0, 1) < 0.1 ? double(IGNORE) : double(tg));
      mask.set(t, r.uniform(0, 1) < 0.15 ? 0.0 : 1.0);
      const bool peaked = t % 8 == 3;
      for (int64_t j = 0; j < V; ++j) logits.set(t * V + j, 3.0 * r.normal() + (peaked && j == tg ? 25.0 : 0.0));
    }
  }
};

struct Outputs {
  HostTensor logp, entropy, lse, dlogits;
};

// Runs forward (logp, entropy, lse) and backward (with the entropy gradient, and without it from
// the saved lse) on rows [off, off + m) of device copies of `b`'s tensors.
Outputs run(const Batch& b, int64_t off, int64_t m, DType grad_dtype, bool with_entropy_grad) {
  const int64_t V = b.logits.shape()[1];
  const DeviceBuffer logits(b.logits), targets(b.targets), mask(b.mask), dlogp(b.dlogp), dentropy(b.dentropy);
  const DeviceBuffer logp(DType::f32, {m}), entropy(DType::f32, {m}), lse(DType::f32, {m}), dlogits(grad_dtype, {m, V});
  LogprobForwardArgs f;
  f.logits = logits.rows(off, off + m);
  f.targets = targets.rows(off, off + m);
  f.loss_mask = mask.rows(off, off + m);
  f.logp = logp.view();
  f.entropy = entropy.view();
  f.lse = lse.view();
  f.ignore_index = IGNORE;
  logprob_forward(cuda_ctx(), f);
  LogprobBackwardArgs g;
  g.logits = f.logits;
  g.targets = f.targets;
  g.loss_mask = f.loss_mask;
  g.lse = f.lse;
  g.dlogp = dlogp.rows(off, off + m);
  if (with_entropy_grad) g.dentropy = dentropy.rows(off, off + m);
  g.dlogits = dlogits.view();
  g.ignore_index = IGNORE;
  logprob_backward(cuda_ctx(), g);
  return {logp.host(), entropy.host(), lse.host(), dlogits.host()};
}

// The rows of a sub-batch, placed at another offset among other neighbours, against the full batch.
void check_invariance(DType dt, int64_t V, int64_t rows, DType grad_dtype) {
  Rng r(uint64_t(V) * 7 + uint64_t(dt));
  const Batch full(r, dt, rows, V);
  for (bool ent : {true, false}) {
    const Outputs want = run(full, 0, rows, grad_dtype, ent);
    for (int64_t m : {int64_t(1), int64_t(2), int64_t(3), int64_t(7), rows / 2 + 1}) {
      const int64_t src = (m * 5) % (rows - m + 1), off = (m * 3) % 5;
      Batch other(r, dt, m + off + 4, V);  // different neighbours on both sides
      other.logits.copy_rows_from(full.logits, src, off, m);
      other.targets.copy_rows_from(full.targets, src, off, m);
      other.mask.copy_rows_from(full.mask, src, off, m);
      other.dlogp.copy_rows_from(full.dlogp, src, off, m);
      other.dentropy.copy_rows_from(full.dentropy, src, off, m);
      const Outputs got = run(other, off, m, grad_dtype, ent);
      const std::string what = std::string(dtype_name(dt)) + " V=" + std::to_string(V) + " m=" + std::to_string(m) +
                               (ent ? " (entropy grad)" : " (saved lse)");
      expect_same_bits(got.logp, want.logp.slice_rows(src, src + m), what + " logp");
      expect_same_bits(got.entropy, want.entropy.slice_rows(src, src + m), what + " entropy");
      expect_same_bits(got.lse, want.lse.slice_rows(src, src + m), what + " lse");
      expect_same_bits(got.dlogits, want.dlogits.slice_rows(src, src + m), what + " dlogits");
    }
  }
}

}  // namespace

class CudaLogprob : public testing_cuda::CudaTest {};

TEST_F(CudaLogprob, InvariantAcrossBatchesOffsetsAndNeighboursBf16) {
  for (int64_t V : {151936, 128256, 32000, 4099, 1031, 7}) check_invariance(DType::bf16, V, 24, DType::bf16);
}

TEST_F(CudaLogprob, InvariantAcrossBatchesOffsetsAndNeighboursFp16AndFp32) {
  check_invariance(DType::f16, 32000, 24, DType::f32);
  check_invariance(DType::f32, 128256, 12, DType::f32);
  check_invariance(DType::f32, 2051, 24, DType::f16);
}

TEST_F(CudaLogprob, HundredRepeatsAreIdentical) {
  Rng r(5);
  const Batch b(r, DType::bf16, 16, 151936);
  const Outputs first = run(b, 0, 16, DType::bf16, true);
  for (int i = 0; i < 100; ++i) {
    const Outputs again = run(b, 0, 16, DType::bf16, true);
    expect_same_bits(again.logp, first.logp, "repeat logp");
    expect_same_bits(again.dlogits, first.dlogits, "repeat dlogits");
  }
}

// Against fp64: logp and entropy within the contract's logprob tolerance (1e-5 absolute), dlogits
// (fp32) within the fp32 reduction tolerance (2e-5 + 2e-5·|ref|). Masked rows are exact zeros.
TEST_F(CudaLogprob, AccurateAgainstFp64) {
  for (int64_t V : {151936, 4099}) {
    Rng r(11 + uint64_t(V));
    const int64_t rows = 12;
    const Batch b(r, DType::bf16, rows, V);
    const Outputs got = run(b, 0, rows, DType::f32, true);
    double worst_lp = 0, worst_h = 0, worst_g = 0;
    for (int64_t t = 0; t < rows; ++t) {
      double m = -INFINITY;
      for (int64_t j = 0; j < V; ++j) m = std::max(m, b.logits.get(t * V + j));
      double s = 0, a = 0;
      for (int64_t j = 0; j < V; ++j) {
        const double z = b.logits.get(t * V + j), e = std::exp(z - m);
        s += e;
        a += e * (m - z);
      }
      const double lse = m + std::log(s), H = std::log(s) + a / s;
      const int32_t tg = int32_t(b.targets.get(t));
      const bool active = b.mask.get(t) != 0 && tg != IGNORE;
      const double lp = active ? b.logits.get(t * V + tg) - lse : 0.0, h = active ? H : 0.0;
      worst_lp = std::max(worst_lp, std::fabs(got.logp.get(t) - lp) / 1e-5);
      worst_h = std::max(worst_h, std::fabs(got.entropy.get(t) - h) / 1e-5);
      EXPECT_LE(std::fabs(got.lse.get(t) - lse), 1e-5) << "lse row " << t;
      const double g = b.dlogp.get(t), ge = b.dentropy.get(t);
      for (int64_t j = 0; j < V; ++j) {
        double want = 0;
        if (active) {
          const double lpj = b.logits.get(t * V + j) - lse, p = std::exp(lpj);
          want = -g * p + (j == tg ? g : 0.0) + ge * (-p * (lpj + H));
        } else {
          ASSERT_EQ(got.dlogits.get(t * V + j), 0.0) << "masked row " << t;
        }
        worst_g = std::max(worst_g, std::fabs(got.dlogits.get(t * V + j) - want) / (2e-5 + 2e-5 * std::fabs(want)));
      }
    }
    std::printf("ACCURACY logprob V=%lld: worst error / tolerance: logp %.3g, entropy %.3g, dlogits %.3g\n",
                (long long)V, worst_lp, worst_h, worst_g);
    EXPECT_LE(worst_lp, 1.0);
    EXPECT_LE(worst_h, 1.0);
    EXPECT_LE(worst_g, 1.0);
  }
}

// A NaN or Inf logit makes its own row NaN and leaves every other row's bits alone.
TEST_F(CudaLogprob, NonFiniteLogitsPoisonOnlyTheirRow) {
  Rng r(3);
  Batch b(r, DType::bf16, 8, 32000);
  for (int64_t t = 0; t < 8; ++t) {
    b.mask.set(t, 1);
    b.targets.set(t, double(t * 100));
  }
  const Outputs clean = run(b, 0, 8, DType::f32, true);
  b.logits.set(2 * 32000 + 17, NAN);
  b.logits.set(5 * 32000 + 31999, INFINITY);
  // A whole 64-column group of NaNs: a max that skipped NaNs and started at −inf took it for an
  // empty group and dropped it, giving row 6 a finite logprob.
  for (int64_t j = 128; j < 192; ++j) b.logits.set(6 * 32000 + j, NAN);
  const Outputs dirty = run(b, 0, 8, DType::f32, true);
  for (int64_t t = 0; t < 8; ++t) {
    if (t == 2 || t == 5 || t == 6) {
      EXPECT_TRUE(std::isnan(dirty.logp.get(t))) << "row " << t;
    } else {
      expect_same_bits(dirty.logp.slice_rows(t, t + 1), clean.logp.slice_rows(t, t + 1), "clean row logp");
      expect_same_bits(dirty.dlogits.slice_rows(t, t + 1), clean.dlogits.slice_rows(t, t + 1), "clean row dlogits");
    }
  }
}

TEST_F(CudaLogprob, OutOfRangeTargetIsAnErrorBeforeAnythingIsWritten) {
  Rng r(9);
  Batch b(r, DType::bf16, 6, 1000);
  b.mask.set(4, 1);
  b.targets.set(4, 1000);  // == V
  b.mask.set(1, 0);
  b.targets.set(1, 5000);  // masked: not read, not an error
  const DeviceBuffer logits(b.logits), targets(b.targets), mask(b.mask), logp(HostTensor::poisoned(DType::f32, {6}));
  LogprobForwardArgs f;
  f.logits = logits.view();
  f.targets = targets.view();
  f.loss_mask = mask.view();
  f.logp = logp.view();
  f.ignore_index = IGNORE;
  try {
    logprob_forward(cuda_ctx(), f);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("targets"), std::string::npos) << msg;
    EXPECT_NE(msg.find("value 1000 at index 4"), std::string::npos) << msg;
  }
  const HostTensor untouched = logp.host();
  for (int64_t t = 0; t < 6; ++t) EXPECT_TRUE(std::isnan(untouched.get(t)));
}

// The deferred check (samebits.torch's mode): the call returns, the bad token's logprob is NaN and
// the others are the waiting mode's bits; a later op — any, waiting or not — raises the error
// naming the call's targets, once.
TEST_F(CudaLogprob, DeferredTargetCheckGivesNaNThenTheError) {
  Rng r(9);
  Batch b(r, DType::bf16, 6, 1000);
  for (int64_t t = 0; t < 6; ++t) b.mask.set(t, 1);
  const DeviceBuffer logits(b.logits), mask(b.mask), logp_wait(DType::f32, {6});
  const DeviceBuffer good(b.targets);
  b.targets.set(4, 1000);  // == V
  const DeviceBuffer bad(b.targets), logp(DType::f32, {6});
  auto args = [&](const DeviceBuffer& targets, const DeviceBuffer& out) {
    LogprobForwardArgs f;
    f.logits = logits.view();
    f.targets = targets.view();
    f.loss_mask = mask.view();
    f.logp = out.view();
    f.ignore_index = IGNORE;
    return f;
  };
  Context deferred = cuda_ctx();
  deferred.id_check = IdCheck::deferred;
  logprob_forward(deferred, args(bad, logp));
  device_synchronize(Backend::cuda);
  try {
    logprob_forward(cuda_ctx(), args(good, logp_wait));
    FAIL() << "the later op raised nothing";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("logprob_forward"), std::string::npos) << msg;
    EXPECT_NE(msg.find("value 1000 at index 4"), std::string::npos) << msg;
  }
  logprob_forward(cuda_ctx(), args(good, logp_wait));  // reported once: this one runs
  const HostTensor got = logp.host(), want = logp_wait.host();
  for (int64_t t = 0; t < 6; ++t) {
    if (t == 4) EXPECT_TRUE(std::isnan(got.get(t)));
    else EXPECT_EQ(got.get(t), want.get(t)) << t;
  }
}

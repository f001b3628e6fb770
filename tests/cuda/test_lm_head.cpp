// CUDA fused LM head -> selected logprob (runs where a GPU is visible; skipped elsewhere): the fused
// forward is bitwise linear_forward (fp32 logits) + logprob_forward; raw-bit invariance of logp,
// entropy, lse and dhidden across batch sizes, offsets and neighbours; dweight chains across
// micro-batches; the vocab chunk width of the backward changes no bit; repeats; accuracy against
// fp64; bad targets; a weight buffer shared with the embedding (tied) gives the untied bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ops/tuning.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "samebits/ops.hpp"
#include "tests/cuda/cuda_test_util.hpp"

namespace {

constexpr int32_t IGNORE = -100;

// Hidden states ~ N(0, 1) and a weight scaled so logits are ~ N(0, 3²); ~10% ignore_index targets,
// ~15% masked tokens, upstream gradients in [-1, 1].
struct Batch {
  HostTensor hidden, weight, targets, mask, dlogp, dentropy;
  Batch(Rng& r, DType dt, int64_t rows, int64_t V, int64_t K)
      : hidden(r.tensor(dt, {rows, K}, -1.7, 1.7)), weight(dt, {V, K}), targets(DType::i32, {rows}),
        mask(DType::u8, {rows}), dlogp(r.tensor(DType::f32, {rows}, -1, 1)),
        dentropy(r.tensor(DType::f32, {rows}, -1, 1)) {
    const double scale = 3.0 / std::sqrt(double(K));
    for (int64_t i = 0; i < V * K; ++i) weight.set(i, scale * r.normal());
    for (int64_t t = 0; t < rows; ++t) {
      targets.set(t, r.uniform(0, 1) < 0.1 ? double(IGNORE) : double(r.integer(0, V - 1)));
      mask.set(t, r.uniform(0, 1) < 0.15 ? 0.0 : 1.0);
    }
  }
  // A batch whose rows [off, off + m) are rows [src, src + m) of `from`, among other neighbours.
  void take_rows(const Batch& from, int64_t src, int64_t off, int64_t m) {
    hidden.copy_rows_from(from.hidden, src, off, m);
    targets.copy_rows_from(from.targets, src, off, m);
    mask.copy_rows_from(from.mask, src, off, m);
    dlogp.copy_rows_from(from.dlogp, src, off, m);
    dentropy.copy_rows_from(from.dentropy, src, off, m);
  }
};

struct Outputs {
  HostTensor logp, entropy, lse, dhidden, dweight;
};

struct Options {
  bool entropy_output = true;
  bool entropy_grad = false;
  bool saved_lse = true;
  bool targets_checked = false;  // the caller vouches for the targets: no range check, no read-back
  int64_t kept_rows = -1;        // >= 0: logits_kept of that many rows (the three-GEMM mode)
  bool frozen = false;           // no dweight (a frozen head): the backward skips its weight gradient
  std::vector<int32_t> segments;  // {row, len} pairs, relative to the call's rows; empty: none
};

// Forward and backward on rows [off, off + m) of device copies of b's tensors; dweight starts from
// `dweight_in` (fp32 [V, K]) when given, else zeros.
Outputs run(const Batch& b, int64_t off, int64_t m, const Options& o = {}, const HostTensor* dweight_in = nullptr) {
  const int64_t V = b.weight.shape()[0], K = b.weight.shape()[1];
  const DeviceBuffer hidden(b.hidden), weight(b.weight), targets(b.targets), mask(b.mask), dlogp(b.dlogp),
      dentropy(b.dentropy);
  const DeviceBuffer logp(DType::f32, {m}), entropy(DType::f32, {m}), lse(DType::f32, {m});
  const DeviceBuffer dhidden(b.hidden.dtype(), {m, K});
  const DeviceBuffer dweight(dweight_in ? *dweight_in : HostTensor(DType::f32, {V, K}));
  const DeviceBuffer kept(DType::f32, {std::max<int64_t>(o.kept_rows, 1), V});
  LmHeadLogprobForwardArgs f;
  f.hidden = hidden.rows(off, off + m);
  f.weight = weight.view();
  f.targets = targets.rows(off, off + m);
  f.loss_mask = mask.rows(off, off + m);
  f.logp = logp.view();
  if (o.entropy_output) f.entropy = entropy.view();
  f.lse = lse.view();
  f.ignore_index = IGNORE;
  f.targets_checked = o.targets_checked;
  if (o.kept_rows >= 0) f.logits_kept = kept.rows(0, o.kept_rows);
  lm_head_logprob_forward(cuda_ctx(), f);
  LmHeadLogprobBackwardArgs g;
  g.hidden = f.hidden;
  g.weight = f.weight;
  g.targets = f.targets;
  g.loss_mask = f.loss_mask;
  if (o.saved_lse) g.lse = f.lse;
  g.dlogp = dlogp.rows(off, off + m);
  if (o.entropy_grad) g.dentropy = dentropy.rows(off, off + m);
  g.dhidden = dhidden.view();
  if (!o.frozen) g.dweight = dweight.view();
  HostTensor seg(DType::i32, {int64_t(o.segments.size() / 2), 2});
  if (!o.segments.empty()) {
    std::memcpy(seg.data(), o.segments.data(), o.segments.size() * sizeof(int32_t));
    g.segments = seg.view();
  }
  g.ignore_index = IGNORE;
  g.targets_checked = o.targets_checked;
  g.logits_kept = f.logits_kept;
  lm_head_logprob_backward(cuda_ctx(), g);
  return {logp.host(), entropy.host(), lse.host(), dhidden.host(), dweight.host()};
}

class CudaLmHead : public testing_cuda::CudaTest {
 protected:
  void TearDown() override { detail::lm_head_vocab_chunk_override() = 0; }
};

}  // namespace

// A frozen head (no dweight): the backward gives the same dhidden bits without the weight gradient —
// on the fused path (one vocab chunk and several), with kept logits, with an entropy gradient, and
// on the composed path (a vocab that is not a multiple of 8).
TEST_F(CudaLmHead, AFrozenHeadGivesTheSameDhiddenWithoutAWeightGradient) {
  struct Case {
    DType dt;
    int64_t V, rows, chunk, kept;
    bool entropy_grad;
  };
  for (const Case c : {Case{DType::bf16, 32000, 130, 0, -1, false}, Case{DType::bf16, 32000, 130, 4096, -1, true},
                       Case{DType::f16, 32000, 64, 0, 64, false}, Case{DType::bf16, 4099, 70, 0, -1, true}}) {
    const int64_t K = 128;
    Rng r(uint64_t(c.V) * 7 + uint64_t(c.rows));
    const Batch b(r, c.dt, c.rows, c.V, K);
    detail::lm_head_vocab_chunk_override() = int(c.chunk);
    Options o;
    o.entropy_grad = c.entropy_grad;
    o.kept_rows = c.kept;
    const Outputs trained = run(b, 0, c.rows, o);
    o.frozen = true;
    const Outputs frozen = run(b, 0, c.rows, o);
    const std::string what = "V " + std::to_string(c.V) + ", chunk " + std::to_string(c.chunk) + ", kept " +
                             std::to_string(c.kept) + (c.entropy_grad ? ", entropy gradient" : "");
    expect_same_bits(frozen.dhidden, trained.dhidden, what + ": dhidden");
    expect_same_bits(frozen.logp, trained.logp, what + ": logp");
  }
}

// The fused forward's logits are the GEMM's fp32 values and its reduction the standalone one: the
// same bits as linear_forward into fp32 followed by logprob_forward.
TEST_F(CudaLmHead, ForwardIsBitwiseGemmThenLogprob) {
  struct Case {
    DType dt;
    int64_t V, rows;
  };
  for (const Case c : {Case{DType::bf16, 151936, 40}, Case{DType::bf16, 128256, 200}, Case{DType::bf16, 32000, 130},
                       Case{DType::f16, 32000, 64}, Case{DType::bf16, 4099, 70}, Case{DType::bf16, 1031, 3}}) {
    const int64_t K = 128;
    Rng r(uint64_t(c.V) + uint64_t(c.rows));
    const Batch b(r, c.dt, c.rows, c.V, K);
    const Outputs got = run(b, 0, c.rows);
    const DeviceBuffer hidden(b.hidden), weight(b.weight), targets(b.targets), mask(b.mask);
    const DeviceBuffer logits(DType::f32, {c.rows, c.V}), logp(DType::f32, {c.rows}), entropy(DType::f32, {c.rows}),
        lse(DType::f32, {c.rows});
    linear_forward(cuda_ctx(), {hidden.view(), weight.view(), {}, logits.view()});
    LogprobForwardArgs f;
    f.logits = logits.view();
    f.targets = targets.view();
    f.loss_mask = mask.view();
    f.logp = logp.view();
    f.entropy = entropy.view();
    f.lse = lse.view();
    f.ignore_index = IGNORE;
    logprob_forward(cuda_ctx(), f);
    const std::string what = std::string(dtype_name(c.dt)) + " V=" + std::to_string(c.V) + " rows=" +
                             std::to_string(c.rows);
    expect_same_bits(got.logp, logp.host(), what + " logp");
    expect_same_bits(got.entropy, entropy.host(), what + " entropy");
    expect_same_bits(got.lse, lse.host(), what + " lse");
  }
}

// A sub-batch at another offset among other neighbours: the same logp / entropy / lse / dhidden
// bits as inside the full batch (V = 4099 takes the composed backward: V is not a multiple of 8).
TEST_F(CudaLmHead, InvariantAcrossBatchesOffsetsAndNeighbours) {
  for (int64_t V : {151936, 32000, 4099}) {
    const int64_t rows = 150, K = 64;
    Rng r(uint64_t(V) * 3);
    const Batch full(r, DType::bf16, rows, V, K);
    for (bool ent : {false, true}) {
      Options o;
      o.entropy_grad = ent;
      const Outputs want = run(full, 0, rows, o);
      for (int64_t m : {int64_t(1), int64_t(7), int64_t(64), int64_t(65), int64_t(130)}) {
        const int64_t src = (m * 5) % (rows - m + 1), off = (m * 3) % 5;
        Batch other(r, DType::bf16, m + off + 4, V, K);
        other.weight = full.weight;
        other.take_rows(full, src, off, m);
        const Outputs got = run(other, off, m, o);
        const std::string what = "V=" + std::to_string(V) + " m=" + std::to_string(m) + (ent ? " (entropy grad)" : "");
        expect_same_bits(got.logp, want.logp.slice_rows(src, src + m), what + " logp");
        expect_same_bits(got.entropy, want.entropy.slice_rows(src, src + m), what + " entropy");
        expect_same_bits(got.lse, want.lse.slice_rows(src, src + m), what + " lse");
        expect_same_bits(got.dhidden, want.dhidden.slice_rows(src, src + m), what + " dhidden");
      }
    }
  }
}

// dweight of one call over four sequences equals two micro-batches split at a sequence boundary,
// the second continuing the first's fp32 accumulator.
TEST_F(CudaLmHead, WeightGradientChainsAcrossMicroBatches) {
  for (int64_t V : {32000, 4104}) {
    const int64_t K = 128;
    const std::vector<int32_t> lens = {37, 100, 64, 5};
    Rng r(uint64_t(V) + 77);
    const Batch b(r, DType::bf16, 206, V, K);
    Options all;
    for (int32_t row = 0, i = 0; i < 4; row += lens[size_t(i)], ++i) all.segments.insert(all.segments.end(), {row, lens[size_t(i)]});
    const Outputs one = run(b, 0, 206, all);
    Options first, second;
    first.segments = {0, 37, 37, 100};
    second.segments = {0, 64, 64, 5};
    const Outputs a = run(b, 0, 137, first);
    const Outputs c = run(b, 137, 69, second, &a.dweight);
    const std::string what = "V=" + std::to_string(V);
    expect_same_bits(c.dweight, one.dweight, what + " dweight, two micro-batches");
    expect_same_bits(a.dhidden, one.dhidden.slice_rows(0, 137), what + " dhidden, first micro-batch");
    expect_same_bits(c.dhidden, one.dhidden.slice_rows(137, 206), what + " dhidden, second micro-batch");
  }
}

// The backward's vocab chunk (forced to 2048, 4096 and 8192 columns, and the default) changes no bit:
// dhidden's reduction continues an fp32 accumulator across chunks, dweight's rows are disjoint.
TEST_F(CudaLmHead, VocabChunkWidthChangesNoBit) {
  Rng r(21);
  const Batch b(r, DType::bf16, 100, 32000, 128);
  const Outputs want = run(b, 0, 100);
  for (int chunk : {2048, 4096, 8192}) {
    detail::lm_head_vocab_chunk_override() = chunk;
    const Outputs got = run(b, 0, 100);
    expect_same_bits(got.dhidden, want.dhidden, "dhidden, chunk " + std::to_string(chunk));
    expect_same_bits(got.dweight, want.dweight, "dweight, chunk " + std::to_string(chunk));
  }
}

// Without the saved lse the backward recomputes the statistics: the same bits.
TEST_F(CudaLmHead, RecomputedStatisticsGiveTheSavedOnesBits) {
  Rng r(23);
  const Batch b(r, DType::bf16, 90, 32000, 64);
  Options saved, recomputed;
  recomputed.saved_lse = false;
  const Outputs a = run(b, 0, 90, saved), c = run(b, 0, 90, recomputed);
  expect_same_bits(c.dhidden, a.dhidden, "dhidden");
  expect_same_bits(c.dweight, a.dweight, "dweight");
}

TEST_F(CudaLmHead, TwentyRepeatsAreIdentical) {
  Rng r(5);
  const Batch b(r, DType::bf16, 200, 151936, 64);
  Options o;
  o.entropy_grad = true;
  const Outputs first = run(b, 0, 200, o);
  for (int i = 0; i < 20; ++i) {
    const Outputs again = run(b, 0, 200, o);
    expect_same_bits(again.logp, first.logp, "repeat logp");
    expect_same_bits(again.dhidden, first.dhidden, "repeat dhidden");
    expect_same_bits(again.dweight, first.dweight, "repeat dweight");
  }
}

// Against fp64 from the same bf16 inputs: logp / entropy within the contract's logprob tolerance
// (1e-5); dhidden and dweight within the bound of their roundings (dlogits to bf16 before the GEMMs:
// at most 2^-8 relative per term; dhidden's output to bf16: 2^-8 of the value) plus fp32 slack.
TEST_F(CudaLmHead, AccurateAgainstFp64) {
  const int64_t T = 40, V = 4096, K = 64;
  Rng r(31);
  const Batch b(r, DType::bf16, T, V, K);
  Options o;
  o.entropy_grad = true;
  const Outputs got = run(b, 0, T, o);
  std::vector<double> dz(size_t(T * V), 0.0);
  double worst_lp = 0, worst_h = 0, worst_dh = 0, worst_dw = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> z(static_cast<size_t>(V));
    double m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += b.hidden.get(t * K + k) * b.weight.get(v * K + k);
      z[size_t(v)] = acc;
      m = std::max(m, acc);
    }
    double s = 0, a = 0;
    for (double zv : z) {
      s += std::exp(zv - m);
      a += std::exp(zv - m) * (m - zv);
    }
    const double lse = m + std::log(s), H = std::log(s) + a / s;
    const int32_t tg = int32_t(b.targets.get(t));
    const bool active = b.mask.get(t) != 0 && tg != IGNORE;
    worst_lp = std::max(worst_lp, std::fabs(got.logp.get(t) - (active ? z[size_t(tg)] - lse : 0.0)) / 1e-5);
    worst_h = std::max(worst_h, std::fabs(got.entropy.get(t) - (active ? H : 0.0)) / 1e-5);
    if (!active) continue;
    const double g = b.dlogp.get(t), ge = b.dentropy.get(t);
    for (int64_t v = 0; v < V; ++v) {
      const double lp = z[size_t(v)] - lse, p = std::exp(lp);
      dz[size_t(t * V + v)] = -g * p + (v == tg ? g : 0.0) + ge * (-p * (lp + H));
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      double want = 0, mag = 0;
      for (int64_t v = 0; v < V; ++v) {
        want += dz[size_t(t * V + v)] * b.weight.get(v * K + k);
        mag += std::fabs(dz[size_t(t * V + v)] * b.weight.get(v * K + k));
      }
      const double tol = std::ldexp(mag, -8) * 1.01 + std::ldexp(std::fabs(want), -8) + 1e-7;
      worst_dh = std::max(worst_dh, std::fabs(got.dhidden.get(t * K + k) - want) / tol);
    }
  for (int64_t v = 0; v < V; ++v)
    for (int64_t k = 0; k < K; ++k) {
      double want = 0, mag = 0;
      for (int64_t t = 0; t < T; ++t) {
        want += dz[size_t(t * V + v)] * b.hidden.get(t * K + k);
        mag += std::fabs(dz[size_t(t * V + v)] * b.hidden.get(t * K + k));
      }
      const double tol = std::ldexp(mag, -8) * 1.01 + 1e-7;
      worst_dw = std::max(worst_dw, std::fabs(got.dweight.get(v * K + k) - want) / tol);
    }
  std::printf("ACCURACY lm_head V=%lld: worst error / tolerance: logp %.3g, entropy %.3g, dhidden %.3g, dweight %.3g\n",
              (long long)V, worst_lp, worst_h, worst_dh, worst_dw);
  EXPECT_LE(worst_lp, 1.0);
  EXPECT_LE(worst_h, 1.0);
  EXPECT_LE(worst_dh, 1.0);
  EXPECT_LE(worst_dw, 1.0);
}

TEST_F(CudaLmHead, OutOfRangeTargetIsAnErrorBeforeAnythingIsWritten) {
  Rng r(9);
  Batch b(r, DType::bf16, 6, 1000, 64);
  b.mask.set(4, 1);
  b.targets.set(4, 1000);  // == V
  const DeviceBuffer hidden(b.hidden), weight(b.weight), targets(b.targets), mask(b.mask),
      logp(HostTensor::poisoned(DType::f32, {6}));
  LmHeadLogprobForwardArgs f;
  f.hidden = hidden.view();
  f.weight = weight.view();
  f.targets = targets.view();
  f.loss_mask = mask.view();
  f.logp = logp.view();
  f.ignore_index = IGNORE;
  try {
    lm_head_logprob_forward(cuda_ctx(), f);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("value 1000 at index 4"), std::string::npos) << msg;
  }
  const HostTensor untouched = logp.host();
  for (int64_t t = 0; t < 6; ++t) EXPECT_TRUE(std::isnan(untouched.get(t)));
}

// A tied model's LM head reads the embedding matrix: one buffer serving both ops gives each op's
// accumulator the bits it has with two equal, separate matrices, so the tied gradient (embedding's
// accumulator + the LM head's, one add) is the untied runs' sum.
TEST_F(CudaLmHead, SharedEmbeddingBufferGivesTheUntiedBits) {
  const int64_t T = 80, V = 32000, K = 128;
  Rng r(41);
  const Batch b(r, DType::bf16, T, V, K);
  HostTensor ids(DType::i32, {T});
  for (int64_t t = 0; t < T; ++t) ids.set(t, double(r.integer(0, V - 1)));
  const HostTensor dy = r.tensor(DType::bf16, {T, K}, -1, 1);
  auto grads = [&](bool shared) {
    const DeviceBuffer table(b.weight), head_copy(b.weight), hidden(b.hidden), targets(b.targets), mask(b.mask),
        dlogp(b.dlogp), d_ids(ids), d_dy(dy);
    const DeviceBuffer dtable(DType::f32, {V, K}), dhead(DType::f32, {V, K}), dhidden(DType::bf16, {T, K});
    EmbeddingBackwardArgs e;
    e.ids = d_ids.view();
    e.dy = d_dy.view();
    e.dtable = dtable.view();
    embedding_backward(cuda_ctx(), e);
    LmHeadLogprobBackwardArgs g;
    g.hidden = hidden.view();
    g.weight = shared ? table.view() : head_copy.view();
    g.targets = targets.view();
    g.loss_mask = mask.view();
    g.dlogp = dlogp.view();
    g.dhidden = dhidden.view();
    g.dweight = dhead.view();
    g.ignore_index = IGNORE;
    lm_head_logprob_backward(cuda_ctx(), g);
    return std::make_pair(dtable.host(), dhead.host());
  };
  const auto tied = grads(true), untied = grads(false);
  expect_same_bits(tied.first, untied.first, "embedding accumulator");
  expect_same_bits(tied.second, untied.second, "LM head accumulator");
}

// Without an entropy output the forward skips the entropy sums: logp and lse keep their bits.
TEST_F(CudaLmHead, ForwardWithoutEntropyKeepsLogpAndLseBits) {
  Rng r(43);
  const Batch b(r, DType::bf16, 130, 151936, 64);
  const Outputs with = run(b, 0, 130);
  Options o;
  o.entropy_output = false;
  const Outputs without = run(b, 0, 130, o);
  expect_same_bits(without.logp, with.logp, "logp");
  expect_same_bits(without.lse, with.lse, "lse");
}

// Targets the caller vouches for (targets_checked: the range check and its read-back skipped) give
// the checked call's bits, forward and backward; unvouched, an out-of-range target is still named.
TEST_F(CudaLmHead, VouchedTargetsSkipTheCheckAndChangeNoBit) {
  Rng r(53);
  Batch b(r, DType::bf16, 96, 32000, 64);
  Options o;
  o.entropy_grad = true;
  const Outputs checked = run(b, 0, 96, o);
  o.targets_checked = true;
  const Outputs vouched = run(b, 0, 96, o);
  expect_same_bits(vouched.logp, checked.logp, "logp");
  expect_same_bits(vouched.entropy, checked.entropy, "entropy");
  expect_same_bits(vouched.lse, checked.lse, "lse");
  expect_same_bits(vouched.dhidden, checked.dhidden, "dhidden");
  expect_same_bits(vouched.dweight, checked.dweight, "dweight");
  b.targets.set(5, 32000.0);
  b.mask.set(5, 1.0);
  o.targets_checked = false;
  EXPECT_THROW(run(b, 0, 96, o), Error);
}

// The three-GEMM mode (logits_kept: the forward keeps the first C rows' fp32 logits, the backward
// derives their dlogits from them) gives the recomputing backward's bits for every C at a sequence's
// edge, with and without an entropy gradient, against a recompute walking the vocab in chunks.
TEST_F(CudaLmHead, KeptLogitsGiveTheRecomputesBits) {
  // bf16 over a vocab of whole units and fp16 over Qwen3's (not a multiple of 256); sequences with a
  // gap between them (rows 30 … 39 belong to none), C at ends and starts; one inactive row whose
  // hidden state is NaN among the kept ones.
  for (const auto& [dt, V] : {std::pair<DType, int64_t>{DType::bf16, 8192}, {DType::f16, 151936}}) {
    Rng r(59);
    Batch b(r, dt, 96, V, 128);
    b.mask.set(5, 0.0);
    for (int64_t k = 0; k < 128; ++k) b.hidden.set(5 * 128 + k, std::nan(""));
    for (const bool entropy_grad : {false, true}) {
      Options o;
      o.entropy_grad = entropy_grad;
      o.segments = {0, 30, 40, 30, 70, 26};
      detail::lm_head_vocab_chunk_override() = 2048;
      const Outputs recomputed = run(b, 0, 96, o);
      detail::lm_head_vocab_chunk_override() = 0;
      for (const int64_t c : {0, 30, 40, 70, 96}) {
        o.kept_rows = c;
        const Outputs kept = run(b, 0, 96, o);
        const std::string at = " (" + std::string(dtype_name(dt)) + ", C = " + std::to_string(c) +
                               ", entropy gradient " + std::to_string(entropy_grad) + ")";
        expect_same_bits(kept.logp, recomputed.logp, "logp" + at);
        expect_same_bits(kept.entropy, recomputed.entropy, "entropy" + at);
        expect_same_bits(kept.dhidden, recomputed.dhidden, "dhidden" + at);
        expect_same_bits(kept.dweight, recomputed.dweight, "dweight" + at);
      }
    }
  }
  Rng r(60);
  const Batch b(r, DType::bf16, 96, 8192, 128);
  Options inside;
  inside.segments = {0, 30, 30, 40, 70, 26};
  inside.kept_rows = 50;  // inside the second sequence: refused, naming the argument
  EXPECT_THROW(run(b, 0, 96, inside), Error);
}

// An inactive row whose hidden state holds NaN leaves dweight finite and the other rows' bits alone.
TEST_F(CudaLmHead, NonFiniteHiddenInMaskedRowsDoesNotReachTheWeightGradient) {
  Rng r(47);
  Batch b(r, DType::bf16, 100, 32000, 64);
  b.mask.set(10, 1);
  b.targets.set(10, 5);
  const Outputs clean = run(b, 0, 100);
  b.mask.set(10, 0);
  const Outputs masked = run(b, 0, 100);
  b.hidden.set(10 * 64 + 3, NAN);
  b.hidden.set(10 * 64 + 9, INFINITY);
  const Outputs dirty = run(b, 0, 100);
  expect_same_bits(dirty.dweight, masked.dweight, "dweight with a NaN hidden row masked out");
  for (int64_t t = 0; t < 100; ++t)
    if (t != 10) expect_same_bits(dirty.dhidden.slice_rows(t, t + 1), clean.dhidden.slice_rows(t, t + 1), "dhidden row");
}

// NaN weight rows make every token's logits NaN in those columns: a whole 64-column group of them
// must poison each row (a max that skipped NaNs from −inf took such a group for an empty one and
// gave finite logprobs), as must a single NaN column.
TEST_F(CudaLmHead, NanWeightRowsPoisonEveryToken) {
  for (const auto& [first, count] : {std::pair<int64_t, int64_t>{128, 64}, {1000, 1}}) {
    Rng r(53);
    Batch b(r, DType::bf16, 40, 4096, 64);
    for (int64_t v = first; v < first + count; ++v)
      for (int64_t k = 0; k < 64; ++k) b.weight.set(v * 64 + k, NAN);
    const Outputs o = run(b, 0, 40);
    for (int64_t t = 0; t < 40; ++t) {
      EXPECT_TRUE(std::isnan(o.lse.get(t))) << "columns " << first << "+" << count << ", row " << t;
      const bool active = b.mask.get(t) != 0 && b.targets.get(t) != IGNORE;
      if (active) {
        EXPECT_TRUE(std::isnan(o.logp.get(t))) << "columns " << first << "+" << count << ", row " << t;
      }
    }
  }
}

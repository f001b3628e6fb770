// The harness must be able to FAIL: planted defects are reported with the right op, tensor and
// first differing index. A test that cannot fail is a defect; so is a harness that cannot.
#include <gtest/gtest.h>

#include <cmath>

#include "samebits/error.hpp"
#include "samebits/harness.hpp"

using namespace samebits;
using namespace samebits::harness;

namespace {

// Base for planted ops: fp32 per-token input x [L, 8], output y [L] (a row sum), a trained
// weight w [8] whose gradient is dweight[j] += Σ_t dy[t]·x[t][j].
class PlantedCase : public OpCase {
 public:
  std::string params_text() const override { return "fp32"; }
  DType dtype() const override { return DType::f32; }
  std::string forward_class() const override { return "reduction"; }
  std::string backward_class() const override { return "reduction"; }
  int64_t min_length() const override { return 4; }
  int64_t max_length() const override { return 9; }
  TensorMap make_params(Rng& r) const override { return {{"w", r.tensor(DType::f32, {8}, -1, 1)}}; }
  // Rows hold small integers (exact in any order), except row 2: {1, 1e8, -1e8, 1, 0...}, whose
  // fp32 sum depends on the order.
  Sequence make_sequence(Rng& r, int64_t len) const override {
    HostTensor x(DType::f32, {len, 8});
    for (int64_t t = 0; t < len; ++t)
      for (int j = 0; j < 8; ++j) x.set(t * 8 + j, double(r.integer(-3, 3)));
    const double sensitive[8] = {1, 1e8, -1e8, 1, 0, 0, 0, 0};
    for (int j = 0; j < 8; ++j) x.set(2 * 8 + j, sensitive[j]);
    return {len, {{"x", x}, {"dy", r.tensor(DType::f32, {len}, -1, 1)}}};
  }
  std::vector<std::pair<std::string, std::string>> loss_terms() const override { return {{"y", "dy"}}; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {}; }
  std::vector<std::string> trained_params() const override { return {}; }

 protected:
  // y[t] = Σ_j x[t][j], in blocks of `block` then the blocks in order, in T (float or double).
  template <class T>
  static void row_sums(CaseIO& io, int64_t block) {
    const HostTensor& x = io.in("x");
    HostTensor& y = io.output("y", io.out_dtype(DType::f32), {});
    for (int64_t t = 0; t < x.rows(); ++t) {
      T total = 0;
      for (int64_t b = 0; b < 8; b += block) {
        T part = 0;
        for (int64_t j = b; j < std::min<int64_t>(8, b + block); ++j) part += T(x.get(t * 8 + j));
        total += part;
      }
      y.set(t, double(total));
    }
  }
};

// A sum whose block size depends on the number of rows in the batch.
class BatchVariantCase : public PlantedCase {
 public:
  std::string op() const override { return "planted_batch_variant"; }
  void run(const Context& ctx, CaseIO& io) const override {
    if (ctx.precision == Precision::truth_fp64) return row_sums<double>(io, 1);
    row_sums<float>(io, 1 + io.batch.rows % 3);
  }
};

// Accumulates in bf16 (rounds after every add): accurate only where sums are small integers.
class Bf16AccumulationCase : public PlantedCase {
 public:
  std::string op() const override { return "planted_bf16_accumulation"; }
  int64_t min_length() const override { return 3; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    Sequence s = PlantedCase::make_sequence(r, len);
    HostTensor& x = s.tokens["x"];
    for (int j = 0; j < 8; ++j) {
      x.set(2 * 8 + j, 0);
      x.set(1 * 8 + j, 1.0 + j / 256.0);  // row 1: bf16 running sums lose the low bits
    }
    return s;
  }
  void run(const Context& ctx, CaseIO& io) const override {
    const HostTensor& x = io.in("x");
    HostTensor& y = io.output("y", io.out_dtype(DType::f32), {});
    for (int64_t t = 0; t < x.rows(); ++t) {
      double acc = 0;
      for (int j = 0; j < 8; ++j) {
        acc += x.get(t * 8 + j);
        if (ctx.precision != Precision::truth_fp64) acc = to_double(bf16_from_double(acc));
      }
      y.set(t, acc);
    }
  }
};

// Writes one element past the end of its output.
class WritePastEndCase : public PlantedCase {
 public:
  std::string op() const override { return "planted_write_past_end"; }
  void run(const Context&, CaseIO& io) const override {
    row_sums<float>(io, 1);
    HostTensor& y = io.outputs.at("y");
    static_cast<float*>(y.data())[y.numel()] = 42.0f;  // lands in the trailing guard
  }
};

// Correct forward; the weight gradient is summed per call, then added to the accumulator, so
// micro-batching changes its bits.
class MicroBatchVariantCase : public PlantedCase {
 public:
  std::string op() const override { return "planted_microbatch_variant"; }
  Sequence make_sequence(Rng& r, int64_t len) const override {
    return {len, {{"x", r.tensor(DType::f32, {len, 8}, -1, 1)}, {"dy", r.tensor(DType::f32, {len}, -1, 1)}}};
  }
  std::vector<std::string> trained_params() const override { return {"w"}; }
  void run(const Context& ctx, CaseIO& io) const override {
    if (ctx.precision == Precision::truth_fp64) row_sums<double>(io, 1); else row_sums<float>(io, 1);
    if (!io.backward) return;
    const HostTensor &x = io.in("x"), &dy = io.in("dy");
    HostTensor& g = io.param_grads.at("w");
    for (int j = 0; j < 8; ++j) {
      float part = 0;
      for (int64_t t = 0; t < x.rows(); ++t)
        if (io.batch.row_mask.get(t) != 0) part += float(dy.get(t)) * float(x.get(t * 8 + j));
      g.set(j, g.get(j) + part);
    }
  }
};

// A backward 1% off: the finite-difference check must catch it.
class WrongGradientCase : public PlantedCase {
 public:
  std::string op() const override { return "planted_wrong_gradient"; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {{"x", "dx"}}; }
  void run(const Context&, CaseIO& io) const override {
    row_sums<double>(io, 1);
    if (!io.backward) return;
    const HostTensor& dy = io.in("dy");
    HostTensor& dx = io.output("dx", io.out_dtype(DType::f32), {8});
    for (int64_t t = 0; t < dy.rows(); ++t)
      for (int j = 0; j < 8; ++j) dx.set(t * 8 + j, 1.01 * dy.get(t));
  }
};

// A backend with the forward of an op but not its backward yet (as CUDA attention once was).
class BackwardNotBuiltCase : public PlantedCase {
 public:
  std::string op() const override { return "planted_backward_not_built"; }
  std::vector<std::pair<std::string, std::string>> grad_pairs() const override { return {{"x", "dx"}}; }
  void run(const Context&, CaseIO& io) const override {
    row_sums<double>(io, 1);
    if (io.backward) throw NotBuilt("planted_backward_not_built", "planted");
  }
};

const Drift* first_failure(const CellResult& cell) {
  for (auto& d : cell.drifts)
    if (d.count > 0) return &d;
  return nullptr;
}

}  // namespace

TEST(HarnessCanFail, BatchVariantReductionIsCaughtWithOpTensorAndIndex) {
  BatchVariantCase c;
  CaseResult r;
  check_invariance(c, SweepOptions{}, r);
  ASSERT_EQ(r.fwd_invariance.status, Status::fail);
  const Drift* d = first_failure(r.fwd_invariance);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->op, "planted_batch_variant");
  EXPECT_EQ(d->tensor, "y");
  EXPECT_EQ(d->first_index_text, "[2]");  // only row 2 is order-sensitive
  EXPECT_EQ(d->count, 1);
  EXPECT_NE(d->message().find("planted_batch_variant"), std::string::npos);
}

TEST(HarnessCanFail, Bf16AccumulationIsCaughtByTheAccuracyCheck) {
  Bf16AccumulationCase c;
  CaseResult r;
  check_accuracy(c, Contract::builtin(), SweepOptions{}, r);
  ASSERT_EQ(r.fwd_accuracy.status, Status::fail);
  const Drift* d = first_failure(r.fwd_accuracy);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->op, "planted_bf16_accumulation");
  EXPECT_EQ(d->tensor, "y");
  EXPECT_EQ(d->first_index_text, "[1]");  // row 1 of the first packed sequence
  EXPECT_GT(d->worst_ratio, 1.0);
}

TEST(HarnessCanFail, WritePastTheEndOfAnOutputIsCaught) {
  WritePastEndCase c;
  CaseResult r;
  check_invariance(c, SweepOptions{}, r);
  ASSERT_EQ(r.fwd_invariance.status, Status::fail);
  const Drift* d = first_failure(r.fwd_invariance);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->check, "guard");
  EXPECT_EQ(d->tensor, "y");
  EXPECT_EQ(d->op, "planted_write_past_end");
}

TEST(HarnessCanFail, MicroBatchDependentWeightGradientIsCaught) {
  MicroBatchVariantCase c;
  CaseResult r;
  check_invariance(c, SweepOptions{}, r);
  EXPECT_EQ(r.fwd_invariance.status, Status::pass);
  ASSERT_EQ(r.bwd_invariance.status, Status::fail);
  const Drift* d = first_failure(r.bwd_invariance);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->tensor, "w");
  EXPECT_EQ(d->check.rfind("micro-batches", 0), 0u) << d->check;
}

TEST(HarnessCanFail, WrongGradientIsCaughtByFiniteDifferences) {
  WrongGradientCase c;
  const auto failures = check_gradients_fd(c, FdOptions{});
  ASSERT_FALSE(failures.empty());
  EXPECT_EQ(failures.front().op, "planted_wrong_gradient");
  EXPECT_EQ(failures.front().tensor.rfind("dx", 0), 0u);
}

TEST(HarnessCanFail, PlantedCasesPassWhereTheyAreCorrect) {
  // The same machinery passes a correct op: the failures above are not the harness's own noise.
  WrongGradientCase c;  // forward is exact and invariant
  CaseResult r;
  check_invariance(c, SweepOptions{}, r);
  EXPECT_EQ(r.fwd_invariance.status, Status::pass);
}

TEST(Harness, AMissingBackwardLeavesTheForwardJudged) {
  // The forward cells are checked (and pass); only the backward cells say NOT BUILT, with the cause.
  BackwardNotBuiltCase c;
  CaseResult r;
  check_invariance(c, SweepOptions{}, r);
  check_accuracy(c, Contract::builtin(), SweepOptions{}, r);
  EXPECT_EQ(r.fwd_invariance.status, Status::pass);
  EXPECT_GT(r.fwd_invariance.comparisons, 0);
  EXPECT_EQ(r.fwd_accuracy.status, Status::pass);
  for (const CellResult* cell : {&r.bwd_invariance, &r.bwd_accuracy}) {
    EXPECT_EQ(cell->status, Status::not_built);
    EXPECT_NE(cell->note.find("not built yet for the planted backend"), std::string::npos) << cell->note;
  }
}

TEST(Harness, CudaCellsWithoutADeviceAreErrorsNamingTheCause) {
  if (cuda_device_present()) GTEST_SKIP() << "a CUDA device is present";
  SweepOptions opt;
  opt.backend = Backend::cuda;
  for (auto& c : builtin_cases()) {
    const CaseResult r = run_case(*c, Contract::builtin(), opt);
    EXPECT_EQ(r.fwd_invariance.status, Status::error) << c->name();
    EXPECT_NE(r.bwd_accuracy.note.find("no CUDA device"), std::string::npos) << r.bwd_accuracy.note;
  }
}

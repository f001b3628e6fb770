// Bad input gets a clear error naming the op, the argument and the problem; nothing is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "samebits/error.hpp"
#include "samebits/host_tensor.hpp"
#include "samebits/ops.hpp"

using namespace samebits;

namespace {

// Runs fn, expects a samebits::Error for (op, argument) whose problem mentions `what`, and checks
// that `guarded` (the op's output buffer) was left untouched.
void expect_error(const std::function<void()>& fn, const std::string& op, const std::string& arg,
                  const std::string& what, const std::vector<float>* guarded = nullptr) {
  std::vector<float> before;
  if (guarded) before = *guarded;
  try {
    fn();
    ADD_FAILURE() << "no error for " << op << " / " << arg;
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), op) << e.what();
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(e.problem().find(what), std::string::npos) << "message: " << e.what();
    EXPECT_NE(std::string(e.what()).find(op), std::string::npos);
  }
  if (guarded) {
    EXPECT_EQ(std::memcmp(before.data(), guarded->data(), before.size() * 4), 0) << "output was written";
  }
}

struct LinearFixture {
  std::vector<float> x = std::vector<float>(4 * 8, 0.5f), w = std::vector<float>(3 * 8, 0.25f),
                     y = std::vector<float>(4 * 3, 7.0f);
  LinearForwardArgs args() {
    LinearForwardArgs a;
    a.x = TensorView::of(x.data(), DType::f32, {4, 8});
    a.weight = TensorView::of(w.data(), DType::f32, {3, 8});
    a.y = TensorView::of(y.data(), DType::f32, {4, 3});
    return a;
  }
};

}  // namespace

TEST(Validation, ValidLinearRuns) {
  LinearFixture f;
  linear_forward(Context{}, f.args());
  EXPECT_EQ(f.y[0], 1.0f);  // 8 · 0.5 · 0.25
}

TEST(Validation, ShapeMismatch) {
  LinearFixture f;
  auto a = f.args();
  a.weight = TensorView::of(f.w.data(), DType::f32, {4, 6});
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "weight", "K, x's columns", &f.y);
  a = f.args();
  a.y = TensorView::of(f.y.data(), DType::f32, {3, 4});
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "y", "M, x's rows", &f.y);
}

TEST(Validation, DtypeMismatch) {
  LinearFixture f;
  auto a = f.args();
  a.weight.dtype = DType::bf16;
  a.weight.shape = {3, 8};
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "weight", "does not match x's", &f.y);
  a = f.args();
  a.x.dtype = DType::i32;
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "x", "floating dtype", &f.y);
}

TEST(Validation, MisalignedView) {
  LinearFixture f;
  auto a = f.args();
  a.x.data = reinterpret_cast<char*>(f.x.data()) + 1;
  a.x.shape = {3, 8};
  a.y.shape = {3, 3};
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "x", "aligned", &f.y);
}

TEST(Validation, NonContiguousView) {
  LinearFixture f;
  auto a = f.args();
  a.x.shape = {2, 8};
  a.x.strides = {16, 1};  // every other row
  a.y.shape = {2, 3};
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "x", "contiguous", &f.y);
}

TEST(Validation, EmptyBatch) {
  LinearFixture f;
  auto a = f.args();
  a.x.shape = {0, 8};
  a.y.shape = {0, 3};
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "x", "empty", &f.y);
  std::vector<int32_t> seqs;
  std::vector<float> q(2 * 1 * 4), out(2 * 1 * 4, 3.0f);
  AttentionForwardArgs at;
  at.q = at.k = at.v = TensorView::of(q.data(), DType::f32, {2, 1, 4});
  at.out = TensorView::of(out.data(), DType::f32, {2, 1, 4});
  at.seqs = TensorView::of(seqs.data(), DType::i32, {0, 4});
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "seqs", "empty batch", &out);
}

TEST(Validation, ZeroLengthSequenceAndBadRanges) {
  std::vector<float> q(6 * 2 * 4, 0.1f), out(6 * 2 * 4, 3.0f);
  AttentionForwardArgs at;
  at.q = at.k = at.v = TensorView::of(q.data(), DType::f32, {6, 2, 4});
  at.out = TensorView::of(out.data(), DType::f32, {6, 2, 4});
  std::vector<int32_t> seqs{0, 3, 0, 3, 3, 0, 3, 0};
  at.seqs = TensorView::of(seqs.data(), DType::i32, {2, 4});
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "seqs", "zero-length sequence", &out);
  seqs = {0, 3, 0, 3, 2, 3, 2, 3};  // query rows overlap
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "seqs", "overlap", &out);
  seqs = {0, 3, 0, 3, 4, 3, 4, 3};  // past the end
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "seqs", "outside", &out);
  seqs = {0, 3, 0, 2, 3, 3, 3, 3};  // more queries than keys
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "seqs", "shorter than q_len", &out);
  seqs = {0, 3, 0, 7, 3, 3, 3, 3};  // a sequence longer than the cache
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "seqs", "rows of k", &out);
  seqs = {0, 3, 0, 3, 3, 3, 3, 3};
  std::vector<float> k3(6 * 3 * 4, 0.1f);  // 2 query heads over 3 key/value heads
  at.k = at.v = TensorView::of(k3.data(), DType::f32, {6, 3, 4});
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "k", "must be a multiple", &out);
}

TEST(Validation, PagedCacheTableErrorsNameTheirCause) {
  std::vector<float> q(6 * 2 * 4, 0.1f), kv(8 * 2 * 4, 0.2f), out(6 * 2 * 4, 3.0f);
  AttentionForwardArgs at;
  at.q = TensorView::of(q.data(), DType::f32, {6, 2, 4});
  at.k = at.v = TensorView::of(kv.data(), DType::f32, {8, 2, 4});
  at.out = TensorView::of(out.data(), DType::f32, {6, 2, 4});
  std::vector<int32_t> seqs{0, 3, 0, 3, 3, 3, 0, 5};
  at.seqs = TensorView::of(seqs.data(), DType::i32, {2, 4});
  std::vector<int32_t> table{1, 0, 0, 1};
  at.block_table = TensorView::of(table.data(), DType::i32, {2, 2});
  at.page_size = 4;
  attention_forward(Context{}, at);  // well formed: runs
  at.page_size = 3;
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "k", "whole pages", &out);
  at.page_size = 2;  // sequence 1 needs 3 pages of 2 rows, the table has 2 columns
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "block_table", "needs 3 pages", &out);
  at.page_size = 4;
  table = {1, 0, 4, 1};  // page 4 of a 2-page pool
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "block_table", "outside the 2 pages", &out);
  table = {1, 0, 1, 0};
  seqs[2] = 1;  // k_row with a block table
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "seqs", "k_row must be 0", &out);
  seqs[2] = 0;
  at.block_table = TensorView::of(table.data(), DType::i32, {1, 4});
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "block_table", "one row per sequence", &out);
  at.block_table = TensorView{};
  expect_error([&] { attention_forward(Context{}, at); }, "attention_forward", "page_size", "no block_table", &out);
}

// Ids outside [0, V) are named with their value and index: int32 ids, and int64 ids (torch's index
// type, read as they are: a value past int32 is named as it is, never wrapped or clamped); other
// integer types are refused by name.
TEST(Validation, TokenIdOutOfRange) {
  std::vector<float> table(10 * 4, 1.0f), y(3 * 4, 5.0f);
  auto expect_named = [&](void* ids, DType dtype, const std::string& problem) {
    EmbeddingForwardArgs a;
    a.ids = TensorView::of(ids, dtype, {3});
    a.table = TensorView::of(table.data(), DType::f32, {10, 4});
    a.y = TensorView::of(y.data(), DType::f32, {3, 4});
    expect_error([&] { embedding_forward(Context{}, a); }, "embedding_forward", "ids", problem, &y);
  };
  auto outside = [](int64_t v) { return "value " + std::to_string(v) + " at index 1 is outside [0, 10)"; };
  for (int32_t bad : {10, -1}) {
    std::vector<int32_t> ids{1, bad, 2};
    expect_named(ids.data(), DType::i32, outside(bad));
  }
  for (int64_t bad : {int64_t(10), int64_t(1) << 40, -(int64_t(1) << 33) + 3}) {
    std::vector<int64_t> ids{1, bad, 2};
    expect_named(ids.data(), DType::i64, outside(bad));
  }
  std::vector<uint8_t> small{1, 2, 3};
  expect_named(small.data(), DType::u8, "expected dtype int32 or int64, got uint8");
}

TEST(Validation, TargetOutOfRangeUnlessMaskedOrIgnored) {
  std::vector<float> logits(3 * 5, 0.0f), logp(3, 9.0f);
  std::vector<int32_t> targets{0, 7, -100};
  std::vector<uint8_t> mask{1, 1, 1};
  LogprobForwardArgs a;
  a.logits = TensorView::of(logits.data(), DType::f32, {3, 5});
  a.targets = TensorView::of(targets.data(), DType::i32, {3});
  a.loss_mask = TensorView::of(mask.data(), DType::u8, {3});
  a.logp = TensorView::of(logp.data(), DType::f32, {3});
  expect_error([&] { logprob_forward(Context{}, a); }, "logprob_forward", "targets", "outside [0, 5)", &logp);
  mask[1] = 0;  // a masked token's target is not looked at
  logprob_forward(Context{}, a);
  EXPECT_EQ(logp[1], 0.0f);
  EXPECT_EQ(logp[2], 0.0f);  // ignore_index
  EXPECT_FLOAT_EQ(logp[0], -std::log(5.0f));
}

TEST(Validation, PositionOutOfRange) {
  std::vector<float> x(2 * 1 * 4, 1.0f), y(2 * 1 * 4, 6.0f);
  for (int32_t bad : {-1, 100}) {
    std::vector<int32_t> pos{0, bad};
    RopeArgs a;
    a.x = TensorView::of(x.data(), DType::f32, {2, 1, 4});
    a.y = TensorView::of(y.data(), DType::f32, {2, 1, 4});
    a.positions = TensorView::of(pos.data(), DType::i32, {2});
    a.config.max_position = 100;
    expect_error([&] { rope_forward(Context{}, a); }, "rope_forward", "positions", "outside [0, 100)", &y);
    // The same checks guard QK-norm fused with RoPE, forward and backward.
    std::vector<float> w(4, 1.0f), dw(4, 0.0f);
    QkNormForwardArgs f;
    f.x = a.x;
    f.weight = TensorView::of(w.data(), DType::f32, {4});
    f.y = a.y;
    f.positions = a.positions;
    f.rope = a.config;
    expect_error([&] { qk_norm_forward(Context{}, f); }, "qk_norm_forward", "positions", "outside [0, 100)", &y);
    QkNormBackwardArgs b;
    b.dy = a.x;
    b.x = a.x;
    b.weight = f.weight;
    b.dx = a.y;
    b.dweight = TensorView::of(dw.data(), DType::f32, {4});
    b.positions = a.positions;
    b.rope = a.config;
    expect_error([&] { qk_norm_backward(Context{}, b); }, "qk_norm_backward", "positions", "outside [0, 100)", &y);
  }
}

TEST(Validation, NonFiniteInput) {
  LinearFixture f;
  f.x[5] = std::nanf("");
  expect_error([&] { linear_forward(Context{}, f.args()); }, "linear_forward", "x", "non-finite value (NaN or Inf) at flat index 5", &f.y);
  f.x[5] = 0.5f;
  f.w[3] = INFINITY;
  expect_error([&] { linear_forward(Context{}, f.args()); }, "linear_forward", "weight", "non-finite", &f.y);
}

TEST(Validation, WrongDeviceAndWrongAccumulator) {
  LinearFixture f;
  auto a = f.args();
  a.x.device = Device::cuda;
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "x", "is on the cuda", &f.y);
  std::vector<uint16_t> dw(3 * 8, 0);
  LinearBackwardWeightArgs b;
  b.dy = TensorView::of(f.y.data(), DType::f32, {4, 3});
  b.x = TensorView::of(f.x.data(), DType::f32, {4, 8});
  b.dweight = TensorView::of(dw.data(), DType::bf16, {3, 8});
  expect_error([&] { linear_backward_weight(Context{}, b); }, "linear_backward_weight", "dweight",
               "gradient accumulators are fp32");
}

TEST(Validation, OutputOverlappingAnInput) {
  LinearFixture f;
  auto a = f.args();
  a.y = TensorView::of(f.x.data(), DType::f32, {4, 3});
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "y", "must not overlap x", &f.x);
}

TEST(Validation, LinearGroupGivesEachPartsOwnCallAndNamesTheBadPart) {
  // Parts of different widths, one with a bias: each y bitwise its own linear_forward.
  std::vector<float> x(5 * 8), w0(3 * 8), w1(2 * 8), b1(2), y0(5 * 3), y1(5 * 2), r0(5 * 3), r1(5 * 2);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(float(i));
  for (size_t i = 0; i < w0.size(); ++i) w0[i] = std::cos(float(i) * 0.7f);
  for (size_t i = 0; i < w1.size(); ++i) w1[i] = std::cos(float(i) * 1.3f);
  b1 = {0.25f, -0.5f};
  auto view = [](std::vector<float>& v, int64_t r, int64_t c) { return TensorView::of(v.data(), DType::f32, {r, c}); };
  LinearGroupForwardArgs g;
  g.x = view(x, 5, 8);
  g.parts[0] = {view(w0, 3, 8), {}, view(y0, 5, 3)};
  g.parts[1] = {view(w1, 2, 8), TensorView::of(b1.data(), DType::f32, {2}), view(y1, 5, 2)};
  g.count = 2;
  linear_group_forward(Context{}, g);
  linear_forward(Context{}, {g.x, g.parts[0].weight, {}, view(r0, 5, 3)});
  linear_forward(Context{}, {g.x, g.parts[1].weight, g.parts[1].bias, view(r1, 5, 2)});
  EXPECT_EQ(std::memcmp(y0.data(), r0.data(), y0.size() * 4), 0);
  EXPECT_EQ(std::memcmp(y1.data(), r1.data(), y1.size() * 4), 0);
  EXPECT_NE(y1[0], 0.0f);

  auto bad = g;
  bad.count = 0;
  expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "count", "1 to 3 parts", &y0);
  bad.count = 4;
  expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "count", "got 4", &y0);
  bad = g;
  std::vector<float> w_short(2 * 6);
  bad.parts[1].weight = view(w_short, 2, 6);
  expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "parts[1].weight",
               "K, x's columns", &y0);
  bad = g;
  bad.parts[1].y = view(y0, 5, 2);  // inside part 0's output
  expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "parts[1].y",
               "must not overlap parts[0].y", &y0);
  // An output over another part's bias: one launch would read the bias while writing it.
  std::vector<float> shared(5 * 3, 0.5f);
  bad = g;
  bad.parts[0].y = view(shared, 5, 3);
  bad.parts[1].bias = TensorView::of(shared.data() + 4, DType::f32, {2});
  expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "parts[0].y",
               "must not overlap parts[1].bias", &shared);
  // And linear_forward's own output over its bias.
  LinearForwardArgs own{g.x, g.parts[1].weight, TensorView::of(shared.data(), DType::f32, {2}), view(shared, 5, 2)};
  expect_error([&] { linear_forward(Context{}, own); }, "linear_forward", "y", "must not overlap bias", &shared);
}

TEST(Validation, LinearGroupSwiGluOutputIsTheElementwiseOpsAndNamesBadArguments) {
  // A group with a swiglu output: gate and up, silu(gate)·up out, bitwise linear_forward of each
  // then swiglu_forward (fp32 and bf16); the parts have no y or bias of their own.
  for (DType dt : {DType::f32, DType::bf16}) {
    HostTensor x(dt, {5, 8}), wg(dt, {3, 8}), wu(dt, {3, 8}), y(dt, {5, 3}), gate(dt, {5, 3}), up(dt, {5, 3}),
        want(dt, {5, 3});
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, std::sin(double(i)));
    for (int64_t i = 0; i < wg.numel(); ++i) wg.set(i, std::cos(double(i) * 0.7)), wu.set(i, std::cos(double(i) * 1.3));
    LinearGroupForwardArgs g;
    g.x = x.view();
    g.count = 2;
    g.parts[0].weight = wg.view();
    g.parts[1].weight = wu.view();
    g.swiglu = y.view();
    linear_group_forward(Context{}, g);
    linear_forward(Context{}, {x.view(), wg.view(), {}, gate.view()});
    linear_forward(Context{}, {x.view(), wu.view(), {}, up.view()});
    swiglu_forward(Context{}, {gate.view(), up.view(), want.view()});
    EXPECT_EQ(std::memcmp(y.data(), want.data(), size_t(y.bytes())), 0) << dtype_name(dt);

    auto bad = g;
    bad.count = 3;
    bad.parts[2].weight = wg.view();
    expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "count", "two parts");
    bad = g;
    bad.parts[0].y = gate.view();
    expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "parts[0].y", "must be absent");
    bad = g;
    bad.parts[1].bias = TensorView::of(wu.data(), dt, {3});
    expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "parts[1].bias", "must be absent");
    HostTensor w_narrow(dt, {2, 8}), y_wide(dt, {5, 4});
    bad = g;
    bad.parts[1].weight = w_narrow.view();
    expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "parts[1].weight", "gate's rows");
    bad = g;
    bad.swiglu = y_wide.view();
    expect_error([&] { linear_group_forward(Context{}, bad); }, "linear_group_forward", "swiglu", "gate's rows");
  }
}

TEST(Validation, QkNormPairGivesEachPartsOwnCallAndNamesTheBadPart) {
  const int64_t T = 3, Hq = 4, Hk = 2, D = 16;
  std::vector<float> xq(T * Hq * D), xk(T * Hk * D), wq(D), wk(D), yq(T * Hq * D), yk(T * Hk * D), rq(T * Hq),
      rk(T * Hk), yq_ref(yq.size()), yk_ref(yk.size()), rq_ref(rq.size()), rk_ref(rk.size());
  for (size_t i = 0; i < xq.size(); ++i) xq[i] = std::sin(float(i) * 0.3f);
  for (size_t i = 0; i < xk.size(); ++i) xk[i] = std::cos(float(i) * 0.7f);
  for (int64_t i = 0; i < D; ++i) wq[size_t(i)] = 1.0f + 0.01f * float(i), wk[size_t(i)] = 0.9f + 0.02f * float(i);
  std::vector<int32_t> pos{7, 8, 40};
  auto t3 = [](std::vector<float>& v, int64_t h) { return TensorView::of(v.data(), DType::f32, {T, h, D}); };
  auto t2 = [](std::vector<float>& v, int64_t h) { return TensorView::of(v.data(), DType::f32, {T, h}); };
  auto t1 = [](std::vector<float>& v) { return TensorView::of(v.data(), DType::f32, {D}); };
  QkNormPairForwardArgs a;
  a.q = {t3(xq, Hq), t1(wq), t3(yq, Hq), t2(rq, Hq)};
  a.k = {t3(xk, Hk), t1(wk), t3(yk, Hk), t2(rk, Hk)};
  a.positions = TensorView::of(pos.data(), DType::i32, {T});
  qk_norm_pair_forward(Context{}, a);
  for (const auto& [x, w, y, r, h] : {std::tuple{&xq, &wq, &yq_ref, &rq_ref, Hq}, std::tuple{&xk, &wk, &yk_ref, &rk_ref, Hk}}) {
    QkNormForwardArgs f{t3(*x, h), t1(*w), t3(*y, h), t2(*r, h)};
    f.positions = a.positions;
    qk_norm_forward(Context{}, f);
  }
  EXPECT_EQ(std::memcmp(yq.data(), yq_ref.data(), yq.size() * 4), 0);
  EXPECT_EQ(std::memcmp(yk.data(), yk_ref.data(), yk.size() * 4), 0);
  EXPECT_EQ(std::memcmp(rq.data(), rq_ref.data(), rq.size() * 4), 0);
  EXPECT_EQ(std::memcmp(rk.data(), rk_ref.data(), rk.size() * 4), 0);
  EXPECT_NE(yk[5], 0.0f);

  auto bad = a;
  std::vector<float> xk_short((T - 1) * Hk * D), yk_short((T - 1) * Hk * D);
  bad.k.x = TensorView::of(xk_short.data(), DType::f32, {T - 1, Hk, D});
  bad.k.y = TensorView::of(yk_short.data(), DType::f32, {T - 1, Hk, D});
  bad.k.rstd = {};
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, "qk_norm_pair_forward", "k.x", "T, q.x's tokens", &yq);
  bad = a;
  bad.q.y = t3(xk, Hk);  // q's output over k's input (the shape check comes first: make it fit)
  bad.q.x = t3(xq, Hk);
  bad.q.rstd = {};
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, "qk_norm_pair_forward", "q.y", "must not overlap k.x",
               &xk);
}

// The pair's cache write (a decode step's paged KV cache): q.y, k.y and the rstds bitwise the pair's
// without it; each token's k.y row and v row in its cache row (-1: none), every other cache row as
// it was; and bad cache arguments named, nothing written.
TEST(Validation, QkNormPairWritesTheCacheRowsAndNamesBadCacheArguments) {
  const int64_t T = 4, Hq = 4, Hk = 2, D = 16, R = 10, row = Hk * D;
  std::vector<float> xq(T * Hq * D), xk(T * row), v(T * row), wq(D), wk(D), yq(T * Hq * D), yk(T * row), rq(T * Hq),
      rk(T * Hk), yq_ref(yq.size()), yk_ref(yk.size()), rq_ref(rq.size()), rk_ref(rk.size()), kc(R * row), vc(R * row);
  for (size_t i = 0; i < xq.size(); ++i) xq[i] = std::sin(float(i) * 0.3f);
  for (size_t i = 0; i < xk.size(); ++i) xk[i] = std::cos(float(i) * 0.7f), v[i] = std::sin(float(i) * 1.3f) * 3.0f;
  for (int64_t i = 0; i < D; ++i) wq[size_t(i)] = 1.0f + 0.01f * float(i), wk[size_t(i)] = 0.9f + 0.02f * float(i);
  for (size_t i = 0; i < kc.size(); ++i) kc[i] = 100.0f + float(i), vc[i] = -100.0f - float(i);
  const std::vector<float> kc0 = kc, vc0 = vc;
  std::vector<int32_t> pos{7, 8, 40, 3}, rows{7, -1, 2, 9};
  auto t3 = [](std::vector<float>& b, int64_t n, int64_t h) { return TensorView::of(b.data(), DType::f32, {n, h, D}); };
  auto t2 = [](std::vector<float>& b, int64_t h) { return TensorView::of(b.data(), DType::f32, {T, h}); };
  auto t1 = [](std::vector<float>& b) { return TensorView::of(b.data(), DType::f32, {D}); };
  QkNormPairForwardArgs ref;
  ref.q = {t3(xq, T, Hq), t1(wq), t3(yq_ref, T, Hq), t2(rq_ref, Hq)};
  ref.k = {t3(xk, T, Hk), t1(wk), t3(yk_ref, T, Hk), t2(rk_ref, Hk)};
  ref.positions = TensorView::of(pos.data(), DType::i32, {T});
  qk_norm_pair_forward(Context{}, ref);
  QkNormPairForwardArgs a = ref;
  a.q.y = t3(yq, T, Hq), a.q.rstd = t2(rq, Hq), a.k.y = t3(yk, T, Hk), a.k.rstd = t2(rk, Hk);
  a.cache_rows = TensorView::of(rows.data(), DType::i32, {T});
  a.k_cache = t3(kc, R, Hk);
  a.v_cache = t3(vc, R, Hk);
  a.v = t3(v, T, Hk);
  qk_norm_pair_forward(Context{}, a);
  EXPECT_EQ(std::memcmp(yq.data(), yq_ref.data(), yq.size() * 4), 0);
  EXPECT_EQ(std::memcmp(yk.data(), yk_ref.data(), yk.size() * 4), 0);
  EXPECT_EQ(std::memcmp(rq.data(), rq_ref.data(), rq.size() * 4), 0);
  EXPECT_EQ(std::memcmp(rk.data(), rk_ref.data(), rk.size() * 4), 0);
  for (int64_t r = 0; r < R; ++r) {
    int64_t t = -1;
    for (int64_t i = 0; i < T; ++i)
      if (rows[size_t(i)] == r) t = i;
    const float *k_want = t >= 0 ? &yk[size_t(t * row)] : &kc0[size_t(r * row)],
                *v_want = t >= 0 ? &v[size_t(t * row)] : &vc0[size_t(r * row)];
    EXPECT_EQ(std::memcmp(&kc[size_t(r * row)], k_want, size_t(row) * 4), 0) << "k cache row " << r << " (token " << t << ")";
    EXPECT_EQ(std::memcmp(&vc[size_t(r * row)], v_want, size_t(row) * 4), 0) << "v cache row " << r << " (token " << t << ")";
  }
  EXPECT_NE(kc[size_t(7 * row)], kc0[size_t(7 * row)]);

  const char* op = "qk_norm_pair_forward";
  auto bad = a;
  bad.k_cache = {};  // all four or none
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "k_cache", "together", &vc);
  bad = ref;
  bad.v = a.v;
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "cache_rows", "together", &yk_ref);
  bad = a;
  bad.cache_rows = TensorView::of(rows.data(), DType::i32, {T - 1});
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "cache_rows", "one cache row per token", &kc);
  bad = a;
  bad.cache_rows.dtype = DType::f32;
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "cache_rows", "expected dtype int32", &kc);
  std::vector<int32_t> far{7, -1, 2, int32_t(R)}, below{7, -2, 2, 9};
  for (std::vector<int32_t>* r : {&far, &below}) {
    bad = a;
    bad.cache_rows = TensorView::of(r->data(), DType::i32, {T});
    expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "cache_rows", "outside [-1, 10)", &kc);
  }
  bad = a;
  bad.k_cache = TensorView::of(kc.data(), DType::f32, {R, 1, 2 * D});
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "k_cache", "k heads", &kc);
  bad = a;
  bad.v_cache = TensorView::of(vc.data(), DType::f32, {R / 2, Hk, D});
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "v_cache", "does not match k_cache's", &vc);
  bad = a;
  bad.v_cache = TensorView::of(vc.data(), DType::bf16, {R, Hk, D});
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "v_cache", "does not match k.y's", &vc);
  bad = a;
  bad.v = t3(v, T - 1, Hk);
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "v", "does not match k.y's", &kc);
  bad = a;
  bad.v_cache.device = Device::cuda;
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "v_cache", "is on the", &kc);
  bad = a;
  bad.v = t3(kc, T, Hk);  // the step's values inside the cache
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "k_cache", "must not overlap v", &kc);
  bad = a;
  bad.v_cache = a.k_cache;
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "k_cache", "must not overlap v_cache", &kc);
  bad = a;
  bad.v = a.k.y;  // the step's values over k's output
  expect_error([&] { qk_norm_pair_forward(Context{}, bad); }, op, "k.y", "must not overlap v", &kc);
}

TEST(Validation, MissingRequiredArgument) {
  LinearFixture f;
  auto a = f.args();
  a.weight = TensorView{};
  expect_error([&] { linear_forward(Context{}, a); }, "linear_forward", "weight", "is required", &f.y);
}

TEST(Validation, CudaBackendChecksArgumentsOrReportsNotBuilt) {
  // Where the CUDA backend is built every op has a CUDA kernel, and its checks refuse host pointers
  // by name; in a build without it, NotBuilt comes before any argument check (the arguments here
  // are host pointers and would fail them).
  std::vector<float> q(4, 0.5f), out(4, 0.0f);
  std::vector<int32_t> seqs{0, 1, 0, 1};
  AttentionBackwardArgs a;
  a.q = a.k = a.v = a.dout = a.out = TensorView::of(q.data(), DType::f32, {1, 1, 4});
  a.dq = a.dk = a.dv = TensorView::of(out.data(), DType::f32, {1, 1, 4});
  a.seqs = TensorView::of(seqs.data(), DType::i32, {1, 4});
  Context cuda;
  cuda.backend = Backend::cuda;
  if (cuda_backend_built())
    expect_error([&] { attention_backward(cuda, a); }, "attention_backward", "q", "is on the cpu", &out);
  else
    EXPECT_THROW(attention_backward(cuda, a), NotBuilt);
  LinearFixture f;
  if (cuda_backend_built()) {
    expect_error([&] { linear_forward(cuda, f.args()); }, "linear_forward", "x", "is on the cpu", &f.y);
  } else {
    EXPECT_THROW(linear_forward(cuda, f.args()), NotBuilt);
  }
  Context truth_on_cuda = cuda;
  truth_on_cuda.precision = Precision::truth_fp64;
  EXPECT_THROW(linear_forward(truth_on_cuda, f.args()), Error);
}

// CUDA embedding (runs where a GPU is visible; skipped elsewhere): the gather copies rows bit for bit,
// and the atomic-free gradient scatter gives the CPU backend's bits (ascending tokens into the fp32
// table) for any batch, duplicate ids, masked rows and micro-batch split; bad ids are errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "samebits/ops.hpp"
#include "tests/cuda/cuda_test_util.hpp"

namespace {

// dtable after adding the gradient of tokens [b, e) on the GPU, or on the CPU (fixed fp32).
HostTensor scatter(const HostTensor& ids, const HostTensor& dy, const HostTensor& mask, HostTensor dtable,
                   const std::vector<std::pair<int64_t, int64_t>>& calls, bool on_gpu) {
  if (!on_gpu) {
    for (auto [b, e] : calls)
      embedding_backward(Context{}, {ids.view().rows(b, e), dy.view().rows(b, e), mask.view().rows(b, e), dtable.view()});
    return dtable;
  }
  const DeviceBuffer di(ids), ddy(dy), dm(mask), dt(dtable);
  for (auto [b, e] : calls) embedding_backward(cuda_ctx(), {di.rows(b, e), ddy.rows(b, e), dm.rows(b, e), dt.view()});
  return dt.host();
}

}  // namespace

class CudaEmbedding : public testing_cuda::CudaTest {};

TEST_F(CudaEmbedding, GatherCopiesTheRowsBitForBit) {
  Rng r(1);
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t H : {64, 100, 4096}) {
      const int64_t V = 1000, T = 333;
      const HostTensor table = r.tensor(dt, {V, H}, -1, 1), ids = r.integers({T}, 0, V - 1);
      const DeviceBuffer dtab(table), did(ids), y(dt, {T, H});
      embedding_forward(cuda_ctx(), {did.view(), dtab.view(), y.view()});
      const HostTensor got = y.host();
      for (int64_t t = 0; t < T; ++t)
        ASSERT_EQ(std::memcmp(static_cast<const char*>(got.data()) + t * H * dtype_size(dt),
                              static_cast<const char*>(table.data()) + int64_t(ids.get(t)) * H * dtype_size(dt),
                              size_t(H) * dtype_size(dt)), 0)
            << dtype_name(dt) << " H=" << H << " token " << t;
    }
  }
}

// Duplicates within and across sequences (ids drawn from a few rows), masked rows, token counts
// that cross the sort's tile (2048) and merge passes, and rows that do not fill 16-byte vectors.
TEST_F(CudaEmbedding, ScatterEqualsTheCpuBitsAndChainsAcrossMicroBatches) {
  Rng r(2);
  struct Shape { int64_t T, V, H, id_range; };
  for (const Shape s : {Shape{1, 50, 64, 50}, Shape{7, 50, 100, 3}, Shape{2048, 1000, 64, 1000},
                        Shape{2049, 300, 256, 20}, Shape{5000, 151936, 136, 151936}, Shape{20000, 4096, 72, 64}}) {
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      const HostTensor ids = r.integers({s.T}, 0, s.id_range - 1), dy = r.tensor(dt, {s.T, s.H}, -1, 1);
      HostTensor mask(DType::u8, {s.T});
      for (int64_t t = 0; t < s.T; ++t) mask.set(t, r.uniform(0, 1) < 0.2 ? 0 : 1);
      const HostTensor init = r.tensor(DType::f32, {s.V, s.H}, -0.5, 0.5);
      const std::string what = std::string(dtype_name(dt)) + " T=" + std::to_string(s.T) + " H=" + std::to_string(s.H);
      const HostTensor cpu = scatter(ids, dy, mask, init, {{0, s.T}}, false);
      expect_same_bits(scatter(ids, dy, mask, init, {{0, s.T}}, true), cpu, what + " one call");
      const int64_t cut = s.T / 3;
      if (cut > 0)
        expect_same_bits(scatter(ids, dy, mask, init, {{0, cut}, {cut, s.T}}, true), cpu, what + " two micro-batches");
    }
  }
}

TEST_F(CudaEmbedding, OutOfRangeIdIsAnErrorNamingIt) {
  HostTensor ids(DType::i32, {5}), mask(DType::u8, {5});
  for (int64_t t = 0; t < 5; ++t) {
    ids.set(t, double(t));
    mask.set(t, 1);
  }
  ids.set(3, 77);
  const HostTensor table(DType::bf16, {10, 16}), dy(DType::bf16, {5, 16});
  const DeviceBuffer did(ids), dtab(table), y(DType::bf16, {5, 16}), ddy(dy), dm(mask), grad(DType::f32, {10, 16});
  for (int pass = 0; pass < 2; ++pass) {
    try {
      if (pass == 0) embedding_forward(cuda_ctx(), {did.view(), dtab.view(), y.view()});
      else embedding_backward(cuda_ctx(), {did.view(), ddy.view(), dm.view(), grad.view()});
      FAIL() << "no error, pass " << pass;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("ids"), std::string::npos) << msg;
      EXPECT_NE(msg.find("value 77 at index 3"), std::string::npos) << msg;
    }
  }
}

// int64 ids (torch's index type, read without a narrowing copy) give the int32 ids' bits, forward and
// backward; a bad int64 id, past int32 too, is named as it is (waiting and deferred checks).
TEST_F(CudaEmbedding, Int64IdsGiveTheInt32Bits) {
  Rng r(5);
  const int64_t T = 3000, V = 5000, H = 136;
  const HostTensor table = r.tensor(DType::bf16, {V, H}, -1, 1), ids = r.integers({T}, 0, 40),
                   dy = r.tensor(DType::bf16, {T, H}, -1, 1);
  HostTensor ids64(DType::i64, {T}), mask(DType::u8, {T});
  for (int64_t t = 0; t < T; ++t) ids64.set(t, ids.get(t)), mask.set(t, t % 5 ? 1 : 0);
  const DeviceBuffer d32(ids), d64(ids64), dtab(table), ddy(dy), dm(mask);
  HostTensor y[2], dtable[2];
  for (int wide = 0; wide < 2; ++wide) {
    const DeviceBuffer out(DType::bf16, {T, H}), grad(HostTensor(DType::f32, {V, H}));
    embedding_forward(cuda_ctx(), {wide ? d64.view() : d32.view(), dtab.view(), out.view()});
    embedding_backward(cuda_ctx(), {wide ? d64.view() : d32.view(), ddy.view(), dm.view(), grad.view()});
    y[wide] = out.host(), dtable[wide] = grad.host();
  }
  expect_same_bits(y[1], y[0], "y");
  expect_same_bits(dtable[1], dtable[0], "dtable");

  HostTensor bad(DType::i64, {4});
  for (int64_t t = 0; t < 4; ++t) bad.set(t, double(t));
  bad.set(2, double(int64_t(1) << 40));
  const DeviceBuffer dbad(bad), y4(DType::bf16, {4, H});
  Context deferred = cuda_ctx();
  deferred.id_check = IdCheck::deferred;
  for (const Context& ctx : {cuda_ctx(), deferred}) {
    try {
      embedding_forward(ctx, {dbad.view(), dtab.view(), y4.view()});
      device_synchronize(Backend::cuda);
      raise_deferred_errors(Backend::cuda);
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("value 1099511627776 at index 2"), std::string::npos) << e.what();
    }
  }
}

// Ids the caller vouches for (ids_checked: the range check and its stream synchronisation skipped)
// give the checked calls' bits, forward and backward.
TEST_F(CudaEmbedding, VouchedIdsSkipTheCheckAndChangeNoBit) {
  Rng r(3);
  const int64_t T = 777, V = 3000, H = 136;
  const HostTensor table = r.tensor(DType::bf16, {V, H}, -1, 1), ids = r.integers({T}, 0, V - 1),
                   dy = r.tensor(DType::bf16, {T, H}, -1, 1);
  HostTensor mask(DType::u8, {T});
  for (int64_t t = 0; t < T; ++t) mask.set(t, t % 7 ? 1 : 0);
  const DeviceBuffer did(ids), dtab(table), ddy(dy), dm(mask);
  HostTensor y[2], dtable[2];
  for (int vouched = 0; vouched < 2; ++vouched) {
    const DeviceBuffer out(DType::bf16, {T, H}), grad(DType::f32, {V, H});
    EmbeddingForwardArgs f{did.view(), dtab.view(), out.view()};
    f.ids_checked = vouched;
    embedding_forward(cuda_ctx(), f);
    EmbeddingBackwardArgs b{did.view(), ddy.view(), dm.view(), grad.view()};
    b.ids_checked = vouched;
    embedding_backward(cuda_ctx(), b);
    y[vouched] = out.host(), dtable[vouched] = grad.host();
  }
  expect_same_bits(y[1], y[0], "y");
  expect_same_bits(dtable[1], dtable[0], "dtable");
}

// Deferred checks (IdCheck::deferred, samebits.torch's mode): the call with a bad id returns without
// waiting, its row NaN and the good rows the table's bits; the first op after the check ran raises
// the error naming that call, the id, its index and the context's note; the op after that runs,
// and good ids give the waiting mode's bits. More deferred checks than the ring of answers holds
// neither hang nor lose the bad one among them.
TEST_F(CudaEmbedding, DeferredCheckIsRaisedByALaterOpAndChangesNoBit) {
  Rng r(4);
  const int64_t T = 5, V = 10, H = 16;
  HostTensor ids(DType::i32, {T}), good(DType::i32, {T});
  for (int64_t t = 0; t < T; ++t) ids.set(t, double(t)), good.set(t, double(T - 1 - t));
  ids.set(3, 77);
  const HostTensor table = r.tensor(DType::bf16, {V, H}, -1, 1);
  const DeviceBuffer did(ids), dgood(good), dtab(table), y(DType::bf16, {T, H}), y_wait(DType::bf16, {T, H});
  Context deferred = cuda_ctx();
  deferred.id_check = IdCheck::deferred;
  deferred.id_note = " (the note)";
  embedding_forward(deferred, {did.view(), dtab.view(), y.view()});  // returns: the check is queued
  device_synchronize(Backend::cuda);
  const HostTensor out = y.host();
  for (int64_t c = 0; c < H; ++c) {
    EXPECT_TRUE(std::isnan(out.get(3 * H + c))) << c;
    EXPECT_EQ(out.get(2 * H + c), table.get(2 * H + c)) << c;
  }
  try {
    embedding_forward(deferred, {dgood.view(), dtab.view(), y.view()});
    FAIL() << "the later op raised nothing";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("embedding_forward"), std::string::npos) << msg;
    EXPECT_NE(msg.find("ids"), std::string::npos) << msg;
    EXPECT_NE(msg.find("value 77 at index 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(the note)"), std::string::npos) << msg;
  }
  embedding_forward(deferred, {dgood.view(), dtab.view(), y.view()});  // reported once: this one runs
  embedding_forward(cuda_ctx(), {dgood.view(), dtab.view(), y_wait.view()});
  expect_same_bits(y.host(), y_wait.host(), "deferred vs waiting check");

  // 3000 queued checks (the ring holds 1024), the bad one among the last: raised by one of the
  // calls after it (whichever first finds its answer landed) or, at the latest, once the GPU is done.
  bool raised = false;
  try {
    for (int i = 0; i < 3000; ++i)
      embedding_forward(deferred, {i == 2990 ? did.view() : dgood.view(), dtab.view(), y.view()});
    device_synchronize(Backend::cuda);
    raise_deferred_errors(Backend::cuda);
  } catch (const Error& e) {
    raised = true;
    EXPECT_NE(std::string(e.what()).find("value 77 at index 3"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(raised);
  device_synchronize(Backend::cuda);
  EXPECT_NO_THROW(raise_deferred_errors(Backend::cuda));
}

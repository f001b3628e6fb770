// The contract file loads and rejects malformed input; results do not depend on the thread count.
#include <gtest/gtest.h>

#include <omp.h>

#include <cstring>

#include "samebits/error.hpp"
#include "samebits/harness.hpp"

using namespace samebits;
using namespace samebits::harness;

TEST(Contract, BuiltinHasEveryClassForEveryStorageDtype) {
  const Contract c = Contract::builtin();
  for (const char* cls : {"elementwise", "reduction", "attention", "logprob"})
    for (DType d : {DType::bf16, DType::f16, DType::f32}) {
      const Tolerance t = c.tolerance(cls, d);
      EXPECT_GE(t.atol, 0.0);
      EXPECT_GE(t.rtol, 0.0);
      EXPECT_GT(t.atol + t.rtol, 0.0) << cls << " " << dtype_name(d);
    }
  EXPECT_THROW(c.tolerance("nonsense", DType::f32), Error);
  EXPECT_THROW(c.tolerance("reduction", DType::i32), Error);
}

TEST(Contract, MalformedJsonIsAClearError) {
  EXPECT_THROW(Contract::from_json("{"), Error);
  EXPECT_THROW(Contract::from_json(R"({"accuracy": {"classes": {"x": {"fp32": {"atol": "a"}}}}})"), Error);
}

TEST(Threads, EveryCaseGivesTheSameBitsWithOneOrTwoThreads) {
  // OpenMP only splits independent outputs; a reduction's order never depends on the split.
  for (auto& c : builtin_cases()) {
    Rng rng(11);
    const TensorMap params = c->make_params(rng);
    Sequence s = c->make_sequence(rng, c->min_length() + 2);
    Batch b;
    b.seqs = {&s};
    b.pieces = {Piece{0, 0, 0, s.length}};
    b.rows = s.length;
    b.tokens = s.tokens;
    b.row_mask = HostTensor(DType::u8, {s.length});
    for (int64_t t = 0; t < s.length; ++t) b.row_mask.set(t, 1);
    TensorMap outs[2];
    TensorMap grads[2];
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      for (auto& name : c->trained_params()) grads[threads - 1][name] = HostTensor(DType::f32, params.at(name).shape());
      CaseIO io(b, params, grads[threads - 1], true, false);
      c->run(Context{}, io);
      outs[threads - 1] = io.outputs;
    }
    for (auto& [name, t] : outs[0])
      EXPECT_EQ(std::memcmp(t.data(), outs[1].at(name).data(), t.bytes()), 0) << c->name() << " " << name;
    for (auto& [name, t] : grads[0])
      EXPECT_EQ(std::memcmp(t.data(), grads[1].at(name).data(), t.bytes()), 0) << c->name() << " " << name;
  }
  omp_set_num_threads(omp_get_num_procs());
}

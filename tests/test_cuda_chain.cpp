// The model chain on the CUDA backend: the chain gate (batch compositions, layouts, chunked prefill
// against the KV cache, generate-then-rescore, micro-batch splits of the weight gradients, repeats)
// bitwise on the GPU, and the fp32 chain against the fp64 chain within the contract, for Qwen3
// (tied and untied) and Llama-3 models; and the chain's errors for memory on the wrong backend.
#include <gtest/gtest.h>

#include "samebits/chain.hpp"
#include "samebits/chain_gate.hpp"
#include "samebits/error.hpp"
#include "samebits/model.hpp"
#include "tests/cuda_test_util.hpp"
#include "tests/model_test_util.hpp"

using namespace samebits;
using samebits::testing_cuda::CudaTest;

namespace {

class CudaChain : public CudaTest {};

void expect_gate_passes(const Model& m, const std::string& label, harness::ChainGateOptions opt) {
  opt.backend = Backend::cuda;
  const harness::CaseResult r = harness::run_chain_gate(m, label, harness::Contract::builtin(), opt);
  for (const harness::CellResult* cell : {&r.fwd_invariance, &r.fwd_accuracy, &r.bwd_invariance, &r.bwd_accuracy}) {
    EXPECT_EQ(cell->status, harness::Status::pass) << label << ": " << cell->note;
    EXPECT_GT(cell->comparisons, 0) << label;
    for (auto& d : cell->drifts)
      if (d.count) ADD_FAILURE() << label << ": " << d.message();
  }
}

}  // namespace

TEST_F(CudaChain, GatePassesOnTheBuiltinQwen3Models) {
  for (bool tied : {false, true}) expect_gate_passes(Model::builtin(tied), tied ? "builtin-tied" : "builtin-untied", {});
}

TEST_F(CudaChain, GatePassesOnALlamaModelInFp16) {
  ModelConfig c = testing_model::builtin_llama_config();
  c.dtype = DType::f16;
  harness::ChainGateOptions opt;
  opt.target_len = 70;
  opt.chunk_sizes = {1, 7, 64};
  expect_gate_passes(Model::random(c, 21), "llama-fp16", opt);
}

TEST(Chain, ACudaChainOnAStreamIsRejectedBeforeAnyDeviceWork) {
  Context ctx;
  ctx.backend = Backend::cuda;
  int not_a_stream = 0;
  ctx.stream = &not_a_stream;  // never used: the check comes first
  const Model m = Model::builtin(false);
  try {
    const Chain chain(m, ctx);
    ADD_FAILURE() << "a CUDA chain accepted a stream";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stream"), std::string::npos) << e.what();
  }
}

TEST_F(CudaChain, CacheAndAccumulatorsOnAnotherBackendAreRejected) {
  const Model m = Model::builtin(false);
  Context ctx;
  ctx.backend = Backend::cuda;
  const Chain chain(m, ctx);
  const ChainBatch b = ChainBatch::packed({{1, 2, 3, 4}});
  KvCache host_cache(m.config(), 1, 8, m.config().dtype);  // CPU memory
  ChainBatch step = b;
  step.seqs[0].slot = 0;
  try {
    chain.forward_cached(step, host_cache);
    ADD_FAILURE() << "a CPU cache was accepted by a CUDA chain";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("backend"), std::string::npos) << e.what();
  }
  const ChainForward f = chain.forward(b);
  ModelGrads host_grads(m, DType::f32);  // CPU memory
  try {
    chain.backward(b, f, std::vector<double>(size_t(b.rows()), 1.0), host_grads);
    ADD_FAILURE() << "CPU accumulators were accepted by a CUDA chain";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("backend"), std::string::npos) << e.what();
  }
}

TEST_F(CudaChain, ActivationsNeedNoPoison) {
  for (bool tied : {false, true}) testing_model::expect_poisoning_changes_no_bit(Model::builtin(tied), Backend::cuda);
}

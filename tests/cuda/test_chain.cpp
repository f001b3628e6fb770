// The model chain on the CUDA backend: the chain gate (batch compositions, layouts, chunked prefill
// against the KV cache, generate-then-rescore, micro-batch splits of the weight gradients, repeats)
// bitwise on the GPU, and the fp32 chain against the fp64 chain within the contract, for Qwen3
// (tied and untied) and Llama-3 models; scoring and per-layer recomputation (their bits and memory);
// and the chain's errors for memory on the wrong backend.
#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <map>

#include "core/captured_graph.hpp"
#include "ops/tuning.hpp"
#include "samebits/chain.hpp"
#include "samebits/device.hpp"
#include "samebits/engine.hpp"
#include "samebits/chain_gate.hpp"
#include "samebits/error.hpp"
#include "samebits/model.hpp"
#include "tests/cuda/cuda_test_util.hpp"
#include "tests/model_test_util.hpp"

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

// Eight sequences of 250 tokens, packed: a batch whose activations dwarf the built-in model's weights.
ChainBatch eight_long_sequences() {
  std::vector<std::vector<int32_t>> seqs;
  for (int s = 0; s < 8; ++s) {
    std::vector<int32_t> t;
    for (int i = 0; i < 250; ++i) t.push_back((s * 131 + i * 17) % 2560);
    seqs.push_back(t);
  }
  return ChainBatch::packed(seqs);
}

bool find_activation_for_test(const ChainForward& f, const std::string& name) {
  for (const auto& [n, t] : f.trace)
    if (n == name) return true;
  return false;
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

// A chain on a stream of its own (the engine's, the one a decode graph is captured on) gives the
// default stream's bits: logprobs and every weight gradient.
TEST_F(CudaChain, AChainOnAStreamOfItsOwnGivesTheDefaultStreamsBits) {
  const Model m = Model::builtin(false);
  const ChainBatch b = ChainBatch::packed({{1, 2, 3, 4, 5, 6, 7}, {9, 8, 7}, {4, 4, 4, 4, 4}});
  DeviceStream stream(Backend::cuda);
  std::vector<std::vector<double>> logp;
  std::vector<std::map<std::string, HostTensor>> grads;
  for (void* s : {static_cast<void*>(nullptr), stream.get()}) {
    Context ctx;
    ctx.backend = Backend::cuda;
    ctx.stream = s;
    const Chain chain(m, ctx);
    const ChainForward f = chain.forward(b);
    logp.push_back(f.logp);
    ModelGrads g(m, DType::f32, Backend::cuda);
    chain.backward(b, f, std::vector<double>(size_t(b.rows()), 1.0), g);
    grads.emplace_back();
    for (const std::string& n : g.names()) grads.back().emplace(n, g.gradient(n));
  }
  EXPECT_EQ(std::memcmp(logp[0].data(), logp[1].data(), logp[0].size() * sizeof(double)), 0) << "logprob bits differ";
  for (auto& [name, t] : grads[0])
    EXPECT_EQ(std::memcmp(t.data(), grads[1].at(name).data(), t.bytes()), 0) << name << ": gradient bits differ";
}

TEST_F(CudaChain, ProgrammaticLaunchesChangeNoBit) {
  // On a stream of its own the chain's kernels may start before the previous one ends (PDL,
  // cuda/common/pdl.cuh): every one waits for it before touching memory. A wait missing or too late
  // would read stale data somewhere in a forward + backward of three sequences, or in a paged
  // prefill + decode: the same bits with programmatic launches forced on and off, five times each.
  const Model m = Model::builtin(false);
  const ChainBatch b = ChainBatch::packed({{1, 2, 3, 4, 5, 6, 7}, {9, 8, 7}, {4, 4, 4, 4, 4}});
  DeviceStream stream(Backend::cuda);
  Context ctx;
  ctx.backend = Backend::cuda;
  ctx.stream = stream.get();
  auto run = [&] {
    const Chain chain(m, ctx);
    const ChainForward f = chain.forward(b);
    ModelGrads g(m, DType::f32, Backend::cuda);
    chain.backward(b, f, std::vector<double>(size_t(b.rows()), 1.0), g);
    std::vector<HostTensor> out{HostTensor(DType::f64, {int64_t(f.logp.size())})};
    std::memcpy(out[0].data(), f.logp.data(), f.logp.size() * sizeof(double));
    for (const std::string& n : g.names()) out.push_back(g.gradient(n));
    EngineOptions o;
    o.backend = Backend::cuda;
    o.page_size = 16;
    GenerationRequest r{{5, 6, 7, 8, 9, 10, 11, 12, 13}, {}};
    r.sampling.n = 3;
    r.sampling.max_new_tokens = 6;
    r.sampling.seed = 4;
    for (const Completion& c : generate(m, {r}, o)) {
      HostTensor t(DType::f64, {int64_t(c.logprobs.size())});
      std::memcpy(t.data(), c.logprobs.data(), c.logprobs.size() * sizeof(double));
      out.push_back(t);
    }
    return out;
  };
  detail::programmatic_launch_override() = -1;
  const std::vector<HostTensor> plain = run();
  detail::programmatic_launch_override() = 1;
  for (int repeat = 0; repeat < 5; ++repeat) {
    const std::vector<HostTensor> early = run();
    ASSERT_EQ(early.size(), plain.size());
    for (size_t i = 0; i < plain.size(); ++i) expect_same_bits(early[i], plain[i], "result " + std::to_string(i));
  }
  detail::programmatic_launch_override() = 0;
}

TEST_F(CudaChain, ScoringKeepsNoActivationsAndGivesTheForwardsBits) {
  // Chain::score on the GPU: forward()'s logprob and entropy bits, in memory that does not grow with
  // the depth (a layer's activations are freed as the next begins; measured by the pool's peak). The
  // kept forward's peak grows by a layer's activations a layer; the scoring peak must not: 2 and 8
  // layers of the built-in shape, the same batch.
  const ChainBatch b = eight_long_sequences();
  Context ctx;
  ctx.backend = Backend::cuda;
  size_t full_peak[2], score_peak[2];
  for (int deep = 0; deep < 2; ++deep) {
    ModelConfig config = Model::builtin(false).config();
    config.num_layers = deep ? 8 : 2;
    const Model m = Model::random(config, 77);
    const Chain chain(m, ctx);
    device_memory_peak(Backend::cuda, /*reset=*/true);
    const size_t before = device_memory_in_use(Backend::cuda);
    std::vector<double> logp, entropy;
    {
      const ChainForward full = chain.forward(b);
      logp = full.logp, entropy = full.entropy;
    }
    full_peak[deep] = device_memory_peak(Backend::cuda, /*reset=*/true) - before;
    const ChainForward scored = chain.score(b);
    score_peak[deep] = device_memory_peak(Backend::cuda, /*reset=*/false) - before;
    EXPECT_EQ(std::memcmp(scored.logp.data(), logp.data(), logp.size() * sizeof(double)), 0) << "logprob bits differ";
    EXPECT_EQ(std::memcmp(scored.entropy.data(), entropy.data(), entropy.size() * sizeof(double)), 0);
    EXPECT_FALSE(scored.activations_kept());
  }
  const size_t per_layer = (full_peak[1] - full_peak[0]) / 6;  // what the kept forward holds a layer
  EXPECT_GT(full_peak[1], full_peak[0] + 3 * (full_peak[0] / 4)) << "the kept forward's peak should grow with depth";
  EXPECT_LT(score_peak[1], score_peak[0] + per_layer / 2)
      << "scoring 8 layers peaked at " << score_peak[1] << " B, 2 layers at " << score_peak[0] << " B (a layer keeps "
      << per_layer << " B)";
  EXPECT_LT(3 * score_peak[1], full_peak[1]) << "scoring peak " << score_peak[1] << " B against the kept forward's "
                                             << full_peak[1];
}

TEST_F(CudaChain, FusedSwiGluScoringGivesTheKeptForwardsBits) {
  // A chain that keeps no layer (Chain::score, every engine step) runs gate + up with a SwiGLU output:
  // with the fused launch forced on, its logprob and entropy bits are the kept forward's (gate, up,
  // then swiglu_forward), and on a Hopper GPU the fused kernel ran once a layer (M <= 64: 3 short
  // sequences, 17 rows).
  const ChainBatch b = ChainBatch::packed({{5, 17, 300, 2}, {9, 9, 9, 9, 9, 1200}, {7, 1, 2, 3, 4, 5, 6}});
  Context ctx;
  ctx.backend = Backend::cuda;
  const Model m = Model::random(Model::builtin(false).config(), 91);
  const Chain chain(m, ctx);
  const ChainForward full = chain.forward(b);
  const detail::ScopedOverride<int> fused(detail::fused_swiglu_override(), 1);
  const long long launches = detail::fused_swiglu_launches();
  const ChainForward scored = chain.score(b);
  EXPECT_EQ(std::memcmp(scored.logp.data(), full.logp.data(), full.logp.size() * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(scored.entropy.data(), full.entropy.data(), full.entropy.size() * sizeof(double)), 0);
  if (captured_graphs_available(Backend::cuda))  // the sm_90a path
    EXPECT_EQ(detail::fused_swiglu_launches() - launches, m.config().num_layers);
}

TEST_F(CudaChain, RecomputingEachLayerGivesTheKeptForwardsBitsInLessMemory) {
  // ForwardKeep::layer_inputs on the GPU: the logprob, entropy, weight-gradient and input-gradient
  // bits of a forward that keeps everything, with a forward + backward peak (the pool's) well under
  // the kept one's at 8 layers: the backward holds one rerun layer at a time.
  ChainBatch b = eight_long_sequences();
  for (size_t i = 0; i < b.loss_mask.size(); i += 5) b.loss_mask[i] = 0;
  std::vector<double> dlogp(size_t(b.rows()));
  for (size_t i = 0; i < dlogp.size(); ++i) dlogp[i] = double(int(i % 7) - 3) / 4;
  ModelConfig config = Model::builtin(false).config();
  config.num_layers = 8;
  const Model m = Model::random(config, 78);
  Context ctx;
  ctx.backend = Backend::cuda;
  const Chain chain(m, ctx);
  struct Run {
    std::vector<double> logp, entropy;
    HostTensor dembed;
    std::map<std::string, HostTensor> grads;
    size_t peak = 0;
  };
  auto train = [&](ForwardKeep keep) {
    Run r;
    ModelGrads g(m, DType::f32, Backend::cuda);
    device_memory_peak(Backend::cuda, /*reset=*/true);
    const size_t before = device_memory_in_use(Backend::cuda);
    {
      const ChainForward f = chain.forward(b, keep);
      r.logp = f.logp, r.entropy = f.entropy;
      r.dembed = chain.backward(b, f, dlogp, g).to_host();
    }
    r.peak = device_memory_peak(Backend::cuda, /*reset=*/false) - before;
    for (const std::string& name : g.names()) r.grads.emplace(name, g.gradient(name));
    return r;
  };
  const Run kept = train(ForwardKeep::all), rerun = train(ForwardKeep::layer_inputs);
  EXPECT_EQ(std::memcmp(rerun.logp.data(), kept.logp.data(), kept.logp.size() * sizeof(double)), 0) << "logp";
  EXPECT_EQ(std::memcmp(rerun.entropy.data(), kept.entropy.data(), kept.entropy.size() * sizeof(double)), 0);
  ASSERT_EQ(rerun.dembed.bytes(), kept.dembed.bytes());
  EXPECT_EQ(std::memcmp(rerun.dembed.data(), kept.dembed.data(), kept.dembed.bytes()), 0) << "input gradient";
  for (const auto& [name, g] : kept.grads) {
    const HostTensor& r = rerun.grads.at(name);
    ASSERT_EQ(r.bytes(), g.bytes()) << name;
    EXPECT_EQ(std::memcmp(r.data(), g.data(), g.bytes()), 0) << name;
  }
  std::cout << "forward + backward peak at 8 layers: all " << kept.peak << " B, layer inputs " << rerun.peak << " B\n";
  EXPECT_LT(2 * rerun.peak, kept.peak) << "recomputing peaked at " << rerun.peak << " B, keeping all at " << kept.peak;
}

TEST_F(CudaChain, KeptLmHeadLogitsChangeNoBitOfATrainingStep) {
  // Chain::set_lm_head_keep_bytes: the LM head keeps the first whole sequences' fp32 logits for the
  // backward (three vocab GEMMs for them): every logprob and gradient bit of the recomputing step,
  // for budgets that hold all eight sequences, three of them, or less than one.
  ChainBatch b = eight_long_sequences();
  for (size_t i = 0; i < b.loss_mask.size(); i += 5) b.loss_mask[i] = 0;
  std::vector<double> dlogp(size_t(b.rows()));
  for (size_t i = 0; i < dlogp.size(); ++i) dlogp[i] = double(int(i % 7) - 3) / 4;
  const Model& m = Model::builtin(false);
  const int64_t per_row = m.config().vocab_size * 6;
  Context ctx;
  ctx.backend = Backend::cuda;
  auto train = [&](int64_t budget, ForwardKeep keep) {
    Chain chain(m, ctx);
    chain.set_lm_head_keep_bytes(budget);
    ModelGrads g(m, DType::f32, Backend::cuda);
    const ChainForward f = chain.forward(b, keep);
    EXPECT_EQ(budget >= per_row * 250, find_activation_for_test(f, "head.logits_kept")) << budget;
    std::map<std::string, HostTensor> out;
    out.emplace("dembed", chain.backward(b, f, dlogp, g).to_host());
    for (const std::string& name : g.names()) out.emplace(name, g.gradient(name));
    HostTensor logp(DType::f64, {int64_t(f.logp.size())});
    std::memcpy(logp.data(), f.logp.data(), logp.bytes());
    out.emplace("logp", logp);
    return out;
  };
  const auto want = train(0, ForwardKeep::all);
  for (const int64_t budget : {per_row * 2000, per_row * 750 + 5, per_row * 100})
    for (const ForwardKeep keep : {ForwardKeep::all, ForwardKeep::layer_inputs}) {
      const auto got = train(budget, keep);
      for (const auto& [name, t] : want) {
        ASSERT_EQ(got.at(name).bytes(), t.bytes()) << name;
        EXPECT_EQ(std::memcmp(got.at(name).data(), t.data(), t.bytes()), 0) << name << ", budget " << budget;
      }
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

// A model over weights already in GPU memory (a framework's parameters) is read in place: the same
// bits as the chain that uploads its own copy, and an update of that memory is what it reads next.
TEST_F(CudaChain, AModelOverGpuMemoryIsReadInPlace) {
  for (bool tied : {false, true}) {
    const Model host = Model::builtin(tied);
    std::map<std::string, DeviceTensor> on_gpu;
    std::map<std::string, TensorView> views;
    for (auto& [name, w] : host.weights()) views[name] = on_gpu.emplace(name, DeviceTensor::from_host(Backend::cuda, w)).first->second.view();
    const Model device = Model::from_views(host.config().to_json(), views);
    EXPECT_EQ(device.device(), Device::cuda);
    Context ctx;
    ctx.backend = Backend::cuda;
    const Chain a(host, ctx), b(device, ctx);
    const ChainBatch batch = ChainBatch::packed({{1, 2, 3, 4, 5, 6, 7}, {9, 8, 7}});
    const ChainForward fa = a.forward(batch), fb = b.forward(batch);
    EXPECT_EQ(0, std::memcmp(fa.logp.data(), fb.logp.data(), fa.logp.size() * sizeof(double)));
    ModelGrads ga(host, DType::f32, Backend::cuda), gb(device, DType::f32, Backend::cuda);
    const std::vector<double> dlogp(batch.loss_mask.begin(), batch.loss_mask.end());
    a.backward(batch, fa, dlogp, ga);
    b.backward(batch, fb, dlogp, gb);
    for (const std::string& name : ga.names()) {
      const harness::HostTensor x = ga.gradient(name), y = gb.gradient(name);
      EXPECT_EQ(0, std::memcmp(x.data(), y.data(), size_t(x.bytes()))) << name;
    }
    // Overwrite the final norm's weights where they are (as an optimizer step does): the same chain's
    // next forward reads the new values, and equals a fresh upload of the new weights.
    DeviceTensor& norm = on_gpu.at("model.norm.weight");
    harness::HostTensor scaled = norm.to_host();
    for (int64_t i = 0; i < scaled.numel(); ++i) scaled.set(i, scaled.get(i) * 1.5);
    norm.upload(scaled);
    const ChainForward fc = b.forward(batch);
    EXPECT_NE(0, std::memcmp(fa.logp.data(), fc.logp.data(), fa.logp.size() * sizeof(double)));
    std::map<std::string, TensorView> host_views = host.weights();
    host_views["model.norm.weight"] = scaled.view();
    const ChainForward fd = Chain(Model::from_views(host.config().to_json(), host_views), ctx).forward(batch);
    EXPECT_EQ(0, std::memcmp(fc.logp.data(), fd.logp.data(), fc.logp.size() * sizeof(double)));
    const Model& moved = device;
    EXPECT_THROW(moved.save("/nonexistent/never-written"), Error);
    Context cpu;
    EXPECT_THROW(Chain(moved, cpu), Error);
  }
}

// Test helpers for the model chain: the built-in model's shape as a Llama-3 model.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "samebits/chain.hpp"
#include "samebits/model.hpp"

namespace samebits::testing_model {

// Llama-3 (no QK-norm, untied, Llama-3 RoPE scaling) with the built-in model's shape; the original
// context is small so the scaling bands fall inside head_dim.
inline ModelConfig builtin_llama_config() {
  ModelConfig c = Model::builtin(false).config();
  c.architecture = "llama";
  c.qk_norm = false;
  c.rope.theta = 500000.0;
  c.rope.llama3_scaling = true;
  c.rope.original_max_position = 64;
  return c;
}

// Activations need no fill: a chain that poisons every activation (NaN bytes) and one that takes
// its memory as it comes (on CUDA: the pool's memory the poisoned run just gave back, NaN-filled
// and stale) give the same bits for logprobs, entropies, every weight gradient and a decode step's
// logits. An element read before an op wrote it would differ or show as NaN.
inline void expect_poisoning_changes_no_bit(const Model& m, Backend backend) {
  const ChainBatch b = ChainBatch::packed({{5, 9, 2, 7, 7, 1, 30, 4, 8}, {3, 1, 4, 1, 5}, {11, 12, 13, 14, 15, 16, 17}});
  struct Run {
    ChainForward f;
    std::vector<harness::HostTensor> grads;
    std::vector<double> step_logits;
  };
  auto run = [&](bool poison) {
    Context ctx;
    ctx.backend = backend;
    ctx.poison_activations = poison;
    const Chain chain(m, ctx);
    Run r;
    r.f = chain.forward(b);
    ModelGrads g(m, DType::f32, backend);
    chain.backward(b, r.f, std::vector<double>(size_t(b.rows()), 1.0), g);
    for (const auto& [name, t] : g.accumulators()) r.grads.push_back(g.gradient(name));
    KvCache cache(m.config(), 1, 16, m.config().dtype, backend);
    ChainBatch prompt = ChainBatch::packed({{5, 9, 2, 7}});
    prompt.seqs[0].slot = 0;
    chain.forward_cached(prompt, cache);
    ChainBatch step = ChainBatch::packed({{7}});
    step.positions = {4};
    step.seqs[0].slot = 0;
    step.seqs[0].cached = 4;
    std::vector<std::vector<double>> logits;
    chain.forward_cached(step, cache, &logits);
    r.step_logits = logits.at(0);
    return r;
  };
  const Run a = run(true), c = run(false);
  auto same = [](const std::vector<double>& x, const std::vector<double>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0;
  };
  EXPECT_TRUE(same(a.f.logp, c.f.logp));
  EXPECT_TRUE(same(a.f.entropy, c.f.entropy));
  EXPECT_TRUE(same(a.step_logits, c.step_logits));
  ASSERT_EQ(a.grads.size(), c.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_EQ(a.grads[i].bytes(), c.grads[i].bytes());
    EXPECT_EQ(std::memcmp(a.grads[i].data(), c.grads[i].data(), a.grads[i].bytes()), 0) << "gradient " << i;
  }
  for (double v : c.f.logp) EXPECT_FALSE(v != v);
}

}  // namespace samebits::testing_model

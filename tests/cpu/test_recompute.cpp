// Per-layer recomputation (ForwardKeep::layer_inputs, issue 29): a forward that keeps each layer's
// input alone, and a backward that reruns each layer before its backward, give every logprob,
// entropy, weight gradient and input-embedding gradient of the forward that keeps everything, bit
// for bit, with a kept trace a fraction of its size.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "samebits/chain.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "samebits/model.hpp"
#include "samebits/rng.hpp"
#include "tests/model_test_util.hpp"
#include "tools/logprobs_io.hpp"

using namespace samebits;

namespace {

// What a training step gives: the forward of every micro-batch and the gradients accumulated over them.
struct Step {
  std::vector<ChainForward> forwards;
  std::vector<HostTensor> dembed;  // each micro-batch's input-embedding gradient
  std::map<std::string, HostTensor> grads;
};

Step train(const Model& m, const std::vector<ChainBatch>& micro_batches, ForwardKeep keep) {
  Context ctx;
  ctx.poison_activations = true;  // a rerun activation read before it is written would show
  const Chain chain(m, ctx);
  ModelGrads g(m, DType::f32);
  Step s;
  Rng rng(17);
  for (const ChainBatch& b : micro_batches) {
    s.forwards.push_back(chain.forward(b, keep));
    std::vector<double> dlogp(size_t(b.rows()));
    for (double& d : dlogp) d = rng.uniform(-1, 1);  // rows the loss mask drops are ignored
    s.dembed.push_back(chain.backward(b, s.forwards.back(), dlogp, g).to_host());
  }
  for (const std::string& name : g.names()) s.grads.emplace(name, g.gradient(name));
  return s;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

bool all_zero(const HostTensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (t.get(i) != 0) return false;
  return true;
}

void expect_same_step(const Step& recomputed, const Step& kept, const std::string& what) {
  ASSERT_EQ(recomputed.forwards.size(), kept.forwards.size()) << what;
  for (size_t i = 0; i < kept.forwards.size(); ++i) {
    EXPECT_TRUE(same_bits(recomputed.forwards[i].logp, kept.forwards[i].logp)) << what << ": logp of micro-batch " << i;
    EXPECT_TRUE(same_bits(recomputed.forwards[i].entropy, kept.forwards[i].entropy)) << what << ": entropy " << i;
    EXPECT_TRUE(same_bits(recomputed.dembed[i], kept.dembed[i])) << what << ": input-embedding gradient " << i;
    EXPECT_FALSE(all_zero(kept.dembed[i])) << what << ": a zero gradient would compare equal whatever ran";
  }
  ASSERT_EQ(recomputed.grads.size(), kept.grads.size()) << what;
  for (const auto& [name, g] : kept.grads) {
    EXPECT_TRUE(same_bits(recomputed.grads.at(name), g)) << what << ": " << name;
    EXPECT_FALSE(all_zero(g)) << what << ": " << name << " is all zero";
  }
}

// Packed sequences of several lengths, some rows out of the loss.
ChainBatch packed_with_masks(const std::vector<std::vector<int32_t>>& seqs) {
  ChainBatch b = ChainBatch::packed(seqs);
  for (size_t i = 0; i < b.loss_mask.size(); i += 3) b.loss_mask[i] = 0;
  return b;
}

std::vector<std::vector<int32_t>> sequences(int64_t vocab) {
  std::vector<std::vector<int32_t>> seqs;
  Rng rng(5);
  for (int64_t len : {9, 1, 17, 4, 12}) {
    std::vector<int32_t> s;
    for (int64_t i = 0; i < len; ++i) s.push_back(int32_t(rng.integer(0, vocab - 1)));
    seqs.push_back(s);
  }
  return seqs;
}

ModelConfig deep(ModelConfig c) {
  c.num_layers = 6;
  c.vocab_size = 700;
  return c;
}

std::vector<std::pair<std::string, Model>> models() {
  std::vector<std::pair<std::string, Model>> out;
  out.emplace_back("builtin", Model::builtin(false));
  out.emplace_back("builtin tied", Model::builtin(true));
  out.emplace_back("qwen3 6 layers", Model::random(deep(Model::builtin(false).config()), 31));
  out.emplace_back("llama 6 layers", Model::random(deep(testing_model::builtin_llama_config()), 32));
  return out;
}

size_t kept_bytes(const ChainForward& f) {
  size_t n = 0;
  for (const auto& [name, t] : f.trace) n += t.bytes();
  return n;
}

}  // namespace

TEST(Recompute, GradientsLogprobsAndEntropiesAreTheKeptForwardsBits) {
  for (const auto& [what, m] : models()) {
    const auto seqs = sequences(m.config().vocab_size);
    const std::vector<ChainBatch> packed{packed_with_masks(seqs)};
    expect_same_step(train(m, packed, ForwardKeep::layer_inputs), train(m, packed, ForwardKeep::all), what + " packed");
    // Padding rows (right-padded slots and an empty slot) are masked out of every gradient alike.
    const std::vector<ChainBatch> padded{ChainBatch::padded(seqs, 20, /*left=*/false, /*empty_slots=*/1)};
    expect_same_step(train(m, padded, ForwardKeep::layer_inputs), train(m, padded, ForwardKeep::all), what + " padded");
  }
}

TEST(Recompute, MicroBatchesStillChainToTheWholeBatchsBits) {
  // Micro-batches each kept as layer inputs alone, their backwards into one set of accumulators:
  // the whole batch's gradient with every activation kept, bit for bit.
  for (const auto& [what, m] : models()) {
    const auto seqs = sequences(m.config().vocab_size);
    const Step whole = train(m, {ChainBatch::packed(seqs)}, ForwardKeep::all);
    std::vector<ChainBatch> parts;
    for (size_t at = 0; at < seqs.size(); at += 2)
      parts.push_back(ChainBatch::packed({seqs.begin() + long(at), seqs.begin() + long(std::min(seqs.size(), at + 2))}));
    // The same dlogp rows: draw them for the whole batch and hand each part its slice.
    Context ctx;
    const Chain chain(m, ctx);
    ModelGrads g(m, DType::f32);
    Rng rng(17);
    std::vector<double> dlogp(size_t(ChainBatch::packed(seqs).rows()));
    for (double& d : dlogp) d = rng.uniform(-1, 1);
    size_t row = 0;
    for (const ChainBatch& b : parts) {
      const std::vector<double> part(dlogp.begin() + long(row), dlogp.begin() + long(row + size_t(b.rows())));
      chain.backward(b, chain.forward(b, ForwardKeep::layer_inputs), part, g);
      row += size_t(b.rows());
    }
    for (const auto& [name, want] : whole.grads)
      EXPECT_TRUE(same_bits(g.gradient(name), want)) << what << ": " << name << " split into micro-batches";
  }
}

TEST(Recompute, GradientsFileIsTheSameWithRecompute) {
  // `samebits grads --recompute` at two micro-batch sizes writes the file `grads` does.
  const Model m = Model::builtin(true);
  const std::string text = "{\"tokens\": [1, 2, 3, 4]}\n{\"tokens\": [5, 6, 7], \"loss_mask\": [0, 1, 0]}\n{\"tokens\": [8, 9]}\n";
  const std::string dir = ::testing::TempDir();
  auto grads_file = [&](int micro_batch, ForwardKeep keep) {
    std::stringstream in(text);
    const std::string path = dir + "/recompute_grads.safetensors";
    const auto seqs = tools::read_sequences(in, m.config(), "grads");
    tools::write_gradients(m, Backend::cpu, seqs, path, micro_batch, {}, keep);
    std::ifstream file(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(file), {});
  };
  const std::string kept = grads_file(16, ForwardKeep::all);
  EXPECT_EQ(grads_file(16, ForwardKeep::layer_inputs), kept);
  EXPECT_EQ(grads_file(1, ForwardKeep::layer_inputs), kept);
}

TEST(Recompute, KeepsLayerInputsAloneAFractionOfTheForward) {
  const Model m = Model::random(deep(Model::builtin(false).config()), 31);
  const Chain chain(m, Context{});
  const ChainBatch b = packed_with_masks(sequences(m.config().vocab_size));
  const ChainForward full = chain.forward(b), inputs = chain.forward(b, ForwardKeep::layer_inputs);
  EXPECT_EQ(inputs.keep, ForwardKeep::layer_inputs);
  EXPECT_TRUE(inputs.activations_kept());
  std::set<std::string> want{"embed", "final.x_in", "final.n1", "final.rstd1", "head.logp", "head.entropy", "head.lse"};
  for (int l = 0; l < 6; ++l)
    for (const char* what : {"x_in", "n1", "rstd1"})
      if (!(l == 0 && std::string(what) == "x_in")) want.insert("layer" + std::to_string(l) + "." + what);
  std::set<std::string> got;
  for (const auto& [name, t] : inputs.trace) got.insert(name);
  EXPECT_EQ(got, want);
  for (const char* name : {"layer0.q", "layer3.attn", "layer5.swiglu", "layer5.down"})
    EXPECT_THROW(inputs.at(name), Error) << name << " was kept";
  for (const auto& [name, t] : inputs.trace)  // each kept tensor is the full forward's, bit for bit
    EXPECT_TRUE(same_bits(t.to_host(), full.at(name).to_host())) << name;
  const size_t all = kept_bytes(full), layer_inputs = kept_bytes(inputs);
  std::cout << "kept bytes at 6 layers, " << b.rows() << " rows: all " << all << ", layer inputs " << layer_inputs << "\n";
  RecordProperty("kept_bytes_all", std::to_string(all));
  RecordProperty("kept_bytes_layer_inputs", std::to_string(layer_inputs));
  EXPECT_LT(layer_inputs * 3, all);
}

TEST(Recompute, ABackwardStillRefusesAScoredForward) {
  const Model m = Model::builtin(false);
  const Chain chain(m, Context{});
  const ChainBatch b = ChainBatch::packed({{1, 2, 3}, {4, 5}});
  const ChainForward none = chain.forward(b, ForwardKeep::none);
  EXPECT_FALSE(none.activations_kept());
  EXPECT_TRUE(same_bits(none.logp, chain.score(b).logp));
  ModelGrads g(m, DType::f32);
  EXPECT_THROW(chain.backward(b, none, std::vector<double>(size_t(b.rows()), 1.0), g), Error);
  // A recomputing forward is not mutated by its backward: a second backward gives the same bits.
  const ChainForward inputs = chain.forward(b, ForwardKeep::layer_inputs);
  ModelGrads g1(m, DType::f32), g2(m, DType::f32);
  const std::vector<double> ones(size_t(b.rows()), 1.0);
  chain.backward(b, inputs, ones, g1);
  chain.backward(b, inputs, ones, g2);
  for (const std::string& name : g1.names()) EXPECT_TRUE(same_bits(g1.gradient(name), g2.gradient(name))) << name;
  EXPECT_EQ(inputs.trace.size(), chain.forward(b, ForwardKeep::layer_inputs).trace.size());
}

// The generation engine on the CPU: a request's tokens and logprobs are the same bits alone, among
// 63 others, arriving mid-decode, under any prefill chunking, queued behind a full cache, with its
// prompt shared by its samples or not, and run to run; its logprobs equal the trainer's rescoring of
// prompt + completion bit for bit; sampling draws what it claims; bad requests fail alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include <nlohmann/json.hpp>

#include "ops/sampling_rule.hpp"
#include "ops/tuning.hpp"
#include "core/captured_graph.hpp"
#include "model/decode_graphs.hpp"
#include "samebits/device.hpp"
#include "samebits/device_tensor.hpp"
#include "samebits/engine.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"
#include "samebits/rng.hpp"
#include "tools/logprobs_io.hpp"

using namespace samebits;

namespace {

std::vector<int32_t> random_prompt(Rng& r, int64_t len, int64_t vocab) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < len; ++i) p.push_back(int32_t(r.integer(0, vocab - 1)));
  return p;
}

// A request of `len` random tokens (from `prompt_seed`) drawing n samples under these settings.
GenerationRequest sampled_request(uint64_t prompt_seed, int64_t len, int64_t n, double temperature, int64_t top_k,
                                  double top_p, int64_t max_new_tokens, uint64_t seed) {
  Rng r(prompt_seed);
  GenerationRequest g{random_prompt(r, len, 2560), {}};
  g.sampling.n = n;
  g.sampling.temperature = temperature;
  g.sampling.top_k = top_k;
  g.sampling.top_p = top_p;
  g.sampling.max_new_tokens = max_new_tokens;
  g.sampling.seed = seed;
  return g;
}

GenerationRequest target_request() { return sampled_request(5, 37, 3, 0.9, 200, 0.95, 12, 1234); }

std::vector<GenerationRequest> others(int n, uint64_t seed) {
  Rng r(seed);
  std::vector<GenerationRequest> out;
  for (int i = 0; i < n; ++i) {
    GenerationRequest g{random_prompt(r, r.integer(1, 90), 2560), {}};
    g.sampling.temperature = r.uniform(0, 1) < 0.2 ? 0.0 : 1.0;
    g.sampling.max_new_tokens = r.integer(1, 20);
    g.sampling.seed = uint64_t(i);
    out.push_back(g);
  }
  return out;
}

// The target's completions from an engine run with `opt`, `before` other requests submitted
// first, `after` submitted after `steps_first` steps.
std::vector<Completion> run_target(const Model& m, EngineOptions opt, const std::vector<GenerationRequest>& before,
                                   int steps_first = 0, const std::vector<GenerationRequest>& after = {}) {
  Engine e(m, opt);
  for (auto& r : before) e.submit(r);
  for (int i = 0; i < steps_first; ++i) e.step();
  const int64_t id = e.submit(target_request());
  for (auto& r : after) e.submit(r);
  std::vector<Completion> got;
  for (Completion& c : e.run())
    if (c.request == id) got.push_back(std::move(c));
  return got;
}

void expect_same(const std::vector<Completion>& got, const std::vector<Completion>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_EQ(got[k].tokens, want[k].tokens) << what << ", sample " << k;
    ASSERT_EQ(got[k].logprobs.size(), want[k].logprobs.size()) << what;
    EXPECT_EQ(std::memcmp(got[k].logprobs.data(), want[k].logprobs.data(), got[k].logprobs.size() * sizeof(double)), 0)
        << what << ", sample " << k << ": logprob bits differ";
    ASSERT_EQ(got[k].sampling_logprobs.size(), got[k].tokens.size()) << what;
    ASSERT_EQ(want[k].sampling_logprobs.size(), want[k].tokens.size()) << what;
    EXPECT_EQ(std::memcmp(got[k].sampling_logprobs.data(), want[k].sampling_logprobs.data(),
                          got[k].sampling_logprobs.size() * sizeof(double)),
              0)
        << what << ", sample " << k << ": sampling logprob bits differ";
    EXPECT_EQ(got[k].finish_reason, want[k].finish_reason) << what;
  }
}

GenerationRequest greedy(uint64_t seed, int64_t prompt_len, int64_t max_new_tokens) {
  Rng r(seed);
  GenerationRequest g{random_prompt(r, prompt_len, 2560), {}};
  g.sampling.temperature = 0;
  g.sampling.max_new_tokens = max_new_tokens;
  return g;
}

// Where an engine test runs: the CPU (the reference, CI), and CUDA where a GPU is present, every
// step eager or decode steps replayed from CUDA graphs (where the device has them).
struct EngineRun {
  Backend backend;
  bool graphs;
};

class EngineOn : public ::testing::TestWithParam<EngineRun> {
 protected:
  void SetUp() override {
    if (backend() == Backend::cuda && !cuda_device_present()) GTEST_SKIP() << "no CUDA device";
    if (GetParam().graphs && !captured_graphs_available(backend())) GTEST_SKIP() << "no CUDA graphs on this device";
  }
  Backend backend() const { return GetParam().backend; }
  EngineOptions opts() const {
    EngineOptions o;
    o.backend = backend();
    o.cuda_graphs = GetParam().graphs;
    return o;
  }
  Context ctx() const {
    Context c;
    c.backend = backend();
    return c;
  }
};

}  // namespace

INSTANTIATE_TEST_SUITE_P(Backends, EngineOn,
                         ::testing::Values(EngineRun{Backend::cpu, false}, EngineRun{Backend::cuda, false},
                                           EngineRun{Backend::cuda, true}),
                         [](const ::testing::TestParamInfo<EngineRun>& i) {
                           return std::string(backend_name(i.param.backend)) + (i.param.graphs ? "_graphs" : "");
                         });

TEST_P(EngineOn, ARequestsBitsDoNotDependOnWhatElseRuns) {
  const Model m = Model::builtin(false);
  const std::vector<Completion> alone = run_target(m, opts(), {});
  ASSERT_EQ(alone.size(), 3u);
  EXPECT_NE(alone[0].tokens, alone[1].tokens) << "samples of one prompt should draw apart";
  for (auto& c : alone) EXPECT_EQ(c.finish_reason, "length");
  expect_same(run_target(m, opts(), {}), alone, "a second run");
  expect_same(run_target(m, opts(), others(63, 1)), alone, "among 63 others");
  {  // CUDA: the persistent decode attention over 3 CTAs, each walking ~44 items (graphs: re-planned each step)
    const detail::ScopedOverride<int> few(detail::attention_persistent_ctas_override(), 3);
    expect_same(run_target(m, opts(), others(63, 1)), alone, "among 63 others, the decode attention on 3 CTAs");
  }
  expect_same(run_target(m, opts(), others(20, 2), 7, others(10, 3)), alone, "arriving while others decode");
  for (int64_t budget : {1, 7, 64, 4096}) {
    EngineOptions o = opts();
    o.max_batch_tokens = budget;
    expect_same(run_target(m, o, others(5, 4)), alone, "prefill chunks of " + std::to_string(budget));
  }
  EngineOptions few = opts();
  few.max_slots = 3;  // the target waits for a free cache and then takes all of it
  expect_same(run_target(m, few, others(6, 5)), alone, "queued behind a full cache");
  EngineOptions unshared = opts();
  unshared.share_prefix = false;
  expect_same(run_target(m, unshared, others(4, 6)), alone, "every sample prefilling its own prompt");
  for (int64_t page : {backend() == Backend::cuda ? 8 : 1, 16, 64}) {  // CUDA pages: multiples of 8
    EngineOptions o = opts();
    o.page_size = page;
    expect_same(run_target(m, o, others(8, 7)), alone, "pages of " + std::to_string(page) + " tokens");
  }
}

TEST_P(EngineOn, PreemptionUnderASmallKvPoolChangesNoBit) {
  const Model m = Model::builtin(false);
  const std::vector<Completion> alone = run_target(m, opts(), {});
  // 24 pages of 8 tokens: the target alone needs 3 samples × 7 pages at its end; 12 others crowd it.
  EngineOptions tight = opts();
  tight.page_size = 8;
  tight.kv_pages = 24;
  tight.max_batch_tokens = 16;
  Engine e(m, tight);
  for (auto& r : others(6, 10)) e.submit(r);
  const int64_t id = e.submit(target_request());
  for (auto& r : others(6, 11)) e.submit(r);
  std::vector<Completion> got;
  for (Completion& c : e.run()) {
    EXPECT_NE(c.finish_reason, "error") << c.error;
    if (c.request == id) got.push_back(std::move(c));
  }
  EXPECT_GT(e.preemptions(), 0) << "the pool was meant to force preemption";
  expect_same(got, alone, "preempted and recomputed");
}

TEST_P(EngineOn, APreemptedRequestWithAnEndedSampleComesBackWithoutIt) {
  // A (40-token prompt, 44 new) and B (n = 2, 36 new) share 3 slots and an 11-page pool of 8-token
  // pages; B's sample 0 ends at its first token (its stop id), so when A's growth preempts B (about
  // step 22) B comes back needing one slot, not two. Then C (n = 3) must still find all three.
  const Model m = Model::builtin(false);
  Rng r(31);
  GenerationRequest a{random_prompt(r, 40, 2560), {}}, b{random_prompt(r, 4, 2560), {}};
  a.sampling.max_new_tokens = 44;
  b.sampling.n = 2;
  b.sampling.max_new_tokens = 36;
  for (uint64_t seed = 0;; ++seed) {  // a seed whose two samples start apart
    b.sampling.seed = seed;
    const auto free_run = generate(m, {b}, opts());
    if (free_run[0].tokens[0] != free_run[1].tokens[0] &&
        std::find(free_run[1].tokens.begin(), free_run[1].tokens.end(), free_run[0].tokens[0]) == free_run[1].tokens.end()) {
      b.sampling.stop_token_ids = {free_run[0].tokens[0]};
      break;
    }
  }
  EngineOptions tight = opts();
  tight.page_size = 8;
  tight.kv_pages = 11;
  tight.max_slots = 3;
  Engine e(m, tight);
  e.submit(a);
  e.submit(b);
  const std::vector<Completion> first = e.run();
  EXPECT_GT(e.preemptions_with_finished_samples(), 0) << e.preemptions() << " preemptions, none with a sample ended";
  ASSERT_EQ(first.size(), 3u);
  expect_same({first[0]}, generate(m, {a}, opts()), "A");
  expect_same({first[1], first[2]}, generate(m, {b}, opts()), "B (preempted)");
  GenerationRequest c = b;
  c.sampling.n = 3;
  c.sampling.stop_token_ids.clear();
  c.sampling.max_new_tokens = 4;
  e.submit(c);
  EXPECT_EQ(e.run().size(), 3u) << "C (n = 3) was never admitted: a slot leaked";
}

TEST_P(EngineOn, TheKvPoolIsSizedFromAMemoryBudget) {
  const Model m = Model::builtin(false);  // 2 layers, 2 kv heads of 64, bf16: 1024 bytes a token
  EngineOptions o = opts();
  o.page_size = 16;
  o.kv_memory_bytes = 100 * 16 * 1024 + 5;
  EXPECT_EQ(Engine(m, o).kv_pages(), 100);
  o.kv_memory_bytes = 1000;
  EXPECT_THROW(Engine(m, o), Error);
  o.kv_memory_bytes = 1 << 20;
  o.kv_pages = 3;
  EXPECT_THROW(Engine(m, o), Error);
}

TEST_P(EngineOn, PagedCacheHoldsTheContiguousBits) {
  const Model m = Model::builtin(false);
  const Chain chain(m, ctx());
  const ModelConfig& c = m.config();
  Rng r(12);
  const std::vector<int32_t> seq = random_prompt(r, 70, c.vocab_size);
  KvCache flat(c, 2, 96, chain.act_dtype(), backend()), paged = KvCache::paged(c, 2, 96, 12, 16, chain.act_dtype(), backend());
  std::vector<double> a, b;
  for (KvCache* cache : {&flat, &paged}) {
    std::vector<double>& out = cache == &flat ? a : b;
    int64_t at = 0;
    for (int64_t chunk : {1, 20, 33, 1, 1, 14}) {  // chunked prefill, then decode steps
      ChainBatch batch;
      batch.seqs.push_back({0, chunk, 1, at});
      for (int64_t i = 0; i < chunk; ++i) {
        batch.tokens.push_back(seq[size_t(at + i)]);
        batch.positions.push_back(int32_t(at + i));
        batch.targets.push_back(seq[size_t(std::min<int64_t>(at + i + 1, 69))]);
        batch.loss_mask.push_back(1);
      }
      ASSERT_TRUE(cache->reserve(1, at + chunk));
      const ChainForward f = chain.forward_cached(batch, *cache);
      out.insert(out.end(), f.logp.begin(), f.logp.end());
      at += chunk;
    }
  }
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)), 0);
  EXPECT_EQ(paged.free_pages(), 12 - 5);
  ASSERT_TRUE(paged.copy_prefix(1, 0, 37));  // two pages shared, the third copied
  EXPECT_EQ(paged.free_pages(), 12 - 6);
  paged.reset(1);
  EXPECT_EQ(paged.free_pages(), 12 - 3);    // the shared pages stay with slot 0
  paged.reset(0);
  EXPECT_EQ(paged.free_pages(), 12);
  EXPECT_FALSE(paged.reserve(0, 97));       // past the slot's capacity
  // A cached step keeps no layer's activations (only the final norm's and the LM head's).
  KvCache fresh = KvCache::paged(c, 1, 96, 6, 16, chain.act_dtype(), backend());
  ChainBatch step = ChainBatch::packed({seq});
  step.seqs[0].slot = 0;
  ASSERT_TRUE(fresh.reserve(0, 70));
  const ChainForward f = chain.forward_cached(step, fresh);
  for (const auto& [name, t] : f.trace) EXPECT_TRUE(name.rfind("final.", 0) == 0 || name.rfind("head.", 0) == 0) << name;
  EXPECT_NO_THROW(f.at("final.n1"));
  EXPECT_GT(chain.forward(ChainBatch::packed({seq})).trace.size(), 4 * f.trace.size()) << "forward() keeps them all";
}

TEST_P(EngineOn, GeneratedLogprobsAreTheTrainersBitForBit) {
  for (bool tied : {false, true}) {
    const Model m = Model::builtin(tied);
    std::vector<GenerationRequest> reqs = others(12, 9);
    reqs[3].sampling.n = 4;
    reqs[5].sampling.top_p = 0.5;
    reqs[6].sampling.min_p = 0.05;
    const std::vector<Completion> out = generate(m, reqs, opts());
    const Chain chain(m, ctx());
    std::stringstream jsonl;
    std::vector<std::vector<int32_t>> full;
    for (const Completion& c : out) {
      ASSERT_EQ(c.finish_reason == "error", false) << c.error;
      std::vector<int32_t> seq = reqs[size_t(c.request)].prompt;
      seq.insert(seq.end(), c.tokens.begin(), c.tokens.end());
      full.push_back(seq);
      nlohmann::json line{{"tokens", seq}};
      jsonl << line.dump() << "\n";
    }
    // The trainer's view: one packed forward of every prompt + completion.
    const ChainBatch packed = ChainBatch::packed(full);
    const ChainForward f = chain.forward(packed);
    std::stringstream scored;
    tools::write_logprobs(m, backend(), jsonl, scored, false);
    for (size_t k = 0; k < out.size(); ++k) {
      const int64_t P = int64_t(reqs[size_t(out[k].request)].prompt.size());
      const int64_t first = packed.seqs[k].row + P - 1;  // row scoring the first generated token
      std::string line;
      std::getline(scored, line);
      const auto cli = nlohmann::json::parse(line)["logprobs"];
      for (size_t t = 0; t < out[k].tokens.size(); ++t) {
        const double want = f.logp[size_t(first) + t];
        EXPECT_EQ(std::memcmp(&out[k].logprobs[t], &want, sizeof(double)), 0)
            << (tied ? "tied" : "untied") << " completion " << k << " token " << t << ": " << out[k].logprobs[t]
            << " vs " << want;
        EXPECT_EQ(float(out[k].logprobs[t]), cli[size_t(P) + t].get<float>()) << "samebits logprobs, completion " << k;
      }
    }
  }
}

TEST_P(EngineOn, GreedyIsTheArgmaxOfTheLogits) {
  const Model m = Model::builtin(false);
  const GenerationRequest g = greedy(3, 20, 6);
  const std::vector<Completion> out = generate(m, {g}, opts());
  ASSERT_EQ(out.size(), 1u);
  const Chain chain(m, ctx());
  std::vector<int32_t> seq = g.prompt;
  for (int32_t tok : out[0].tokens) {
    const ChainBatch b = ChainBatch::packed({seq});
    const ChainForward f = chain.forward(b);
    const auto logits = chain.row_logits(f, {b.rows() - 1})[0];
    const int32_t want = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(tok, want);
    seq.push_back(tok);
  }
}

TEST_P(EngineOn, SamplingLogprobsAreTheDrawsOwnDistribution) {
  // Each token's sampling logprob is log p under the distribution it was drawn from: the fp32 logits
  // of its row (the trainer's), tempered and cut to the kept set (checked in fp64); greedy's are 0.
  const Model m = Model::builtin(false);
  Rng r(21);
  GenerationRequest g{random_prompt(r, 12, 2560), {}};
  g.sampling.n = 2;
  g.sampling.temperature = 0.8;
  g.sampling.top_k = 40;
  g.sampling.top_p = 0.9;
  g.sampling.max_new_tokens = 5;
  g.sampling.seed = 5;
  const GenerationRequest greedy_request = greedy(6, 9, 4);
  const std::vector<Completion> out = generate(m, {g, greedy_request}, opts());
  ASSERT_EQ(out.size(), 3u);
  const Chain chain(m, ctx());
  int checked = 0;
  for (size_t k = 0; k < 2; ++k) {
    std::vector<int32_t> seq = g.prompt;
    ASSERT_EQ(out[k].sampling_logprobs.size(), out[k].tokens.size());
    for (size_t t = 0; t < out[k].tokens.size(); ++t) {
      const ChainBatch b = ChainBatch::packed({seq});
      const auto logits = chain.row_logits(chain.forward(b), {b.rows() - 1})[0];
      const std::vector<int32_t> kept = sampling_candidates(logits, g.sampling);
      const int32_t tok = out[k].tokens[t];
      ASSERT_TRUE(std::binary_search(kept.begin(), kept.end(), tok));
      const double top = *std::max_element(logits.begin(), logits.end());
      double z = 0;
      for (int32_t i : kept) z += std::exp((logits[size_t(i)] - top) / g.sampling.temperature);
      const double truth = (logits[size_t(tok)] - top) / g.sampling.temperature - std::log(z);
      EXPECT_NEAR(out[k].sampling_logprobs[t], truth, 1e-5) << "sample " << k << " token " << t;
      EXPECT_LE(out[k].sampling_logprobs[t], 0.0);
      checked += kept.size() > 1;
      seq.push_back(tok);
    }
  }
  EXPECT_GT(checked, 0) << "every draw had one candidate: the test checks nothing";
  for (double x : out[2].sampling_logprobs) EXPECT_EQ(x, 0.0) << "greedy";
  EXPECT_EQ(out[2].sampling_logprobs.size(), out[2].tokens.size());
}

TEST_P(EngineOn, StopTokensEndASampleAndAreKept) {
  const Model m = Model::builtin(false);
  GenerationRequest g = greedy(4, 10, 8);
  const std::vector<Completion> free_run = generate(m, {g}, opts());
  ASSERT_GE(free_run[0].tokens.size(), 3u);
  g.sampling.stop_token_ids = {free_run[0].tokens[2]};
  const std::vector<Completion> stopped = generate(m, {g}, opts());
  ASSERT_EQ(stopped[0].finish_reason, "stop");
  const auto first = std::find(free_run[0].tokens.begin(), free_run[0].tokens.end(), free_run[0].tokens[2]);
  EXPECT_EQ(stopped[0].tokens, std::vector<int32_t>(free_run[0].tokens.begin(), first + 1));
}

TEST_P(EngineOn, OverlappedStepsChangeNoBit) {
  // overlap_steps launches step N + 1 before step N's draws are applied (its decode rows take those
  // tokens on the device, or from the host's copy of an eager step's draws): the same completions,
  // bit for bit, as steps that wait for their draws — through stop tokens (a sample that stopped at
  // step N has drawn once more in N + 1, dropped), lengths ending, n samples sharing a prompt,
  // arrivals mid-decode and a pool small enough to preempt.
  const Model m = Model::builtin(false);
  std::vector<GenerationRequest> reqs = others(12, 31);
  for (int i = 0; i < 4; ++i) {
    GenerationRequest g = sampled_request(40 + uint64_t(i), 20 + 9 * i, 3, 1.0, 0, 1.0, 24, 7 + uint64_t(i));
    for (int32_t t = 0; t < 2560; t += 19 + i) g.sampling.stop_token_ids.push_back(t);  // ~5% a draw: some stop
    reqs.push_back(g);
  }
  auto run = [&](bool overlap, int64_t kv_pages) {
    EngineOptions o = opts();
    o.overlap_steps = overlap;
    o.page_size = 8;
    o.kv_pages = kv_pages;
    o.max_batch_tokens = kv_pages ? 16 : 2048;
    auto e = std::make_unique<Engine>(m, o);
    for (size_t i = 0; i < reqs.size(); ++i) {
      e->submit(reqs[i]);
      if (i % 4 == 3) e->step();  // arrivals while others decode
    }
    std::vector<Completion> out = e->run();
    std::sort(out.begin(), out.end(), [](const Completion& a, const Completion& b) {
      return std::tie(a.request, a.sample) < std::tie(b.request, b.sample);
    });
    for (const Completion& c : out) EXPECT_NE(c.finish_reason, "error") << c.error;
    return std::make_pair(std::move(out), std::move(e));
  };
  const auto waited = run(false, 0);
  const auto overlapped = run(true, 0);
  EXPECT_EQ(waited.second->overlapped_steps(), 0);
  EXPECT_GT(overlapped.second->overlapped_steps(), 10) << "decode steps should overlap";
  const int64_t stops = std::count_if(waited.first.begin(), waited.first.end(),
                                      [](const Completion& c) { return c.finish_reason == "stop"; });
  EXPECT_GE(stops, 3) << "the test should end samples on stop tokens";
  expect_same(overlapped.first, waited.first, "overlapped vs waiting steps");
  const auto tight = run(true, 40);
  EXPECT_GT(tight.second->preemptions(), 0) << "the pool was meant to force preemption";
  expect_same(tight.first, waited.first, "overlapped steps under preemption");
}

TEST_P(EngineOn, AProgressCallbackThatThrowsLeavesTheEngineWhole) {
  // The callback runs last in a step, after the step is in flight and the one before applied: a
  // throw there loses nothing, and run() again carries on to the same completions.
  const Model m = Model::builtin(false);
  const std::vector<GenerationRequest> reqs = others(6, 41);
  const std::vector<Completion> want = generate(m, reqs, opts());
  Engine e(m, opts());
  for (const auto& r : reqs) e.submit(r);
  int calls = 0;
  e.on_progress([&](int64_t, int64_t) {
    if (++calls == 4) throw std::runtime_error("a callback's own error");
  });
  EXPECT_THROW(e.run(), std::runtime_error);
  expect_same(e.run(), want, "run() again after the callback threw");
}

TEST_P(EngineOn, GatheredTokensAreTheDrawsANegativeOneAsZero) {
  // gather_tokens (a decode step's tokens from the step before, on the device): dst[dst_rows[i]] ←
  // src[src_rows[i]], a failed draw's −1 written as 0 (an id the embedding can read; its row is dropped).
  const std::vector<int32_t> src{7, -1, 2559, 4}, dst_rows{3, 0, 1}, src_rows{2, 1, 3};
  std::vector<int32_t> dst{9, 9, 9, 9, 9};
  const Backend be = backend();
  auto up = [&](const std::vector<int32_t>& v) {
    HostTensor h(DType::i32, {int64_t(v.size())});
    std::memcpy(h.data(), v.data(), v.size() * 4);
    return DeviceTensor::from_host(be, h);
  };
  DeviceTensor d_src = up(src), d_dst = up(dst), d_dr = up(dst_rows), d_sr = up(src_rows);
  gather_tokens(be, static_cast<int32_t*>(d_dst.view().data), static_cast<const int32_t*>(d_src.view().data),
                static_cast<const int32_t*>(d_dr.view().data), static_cast<const int32_t*>(d_sr.view().data), 3);
  const HostTensor got = d_dst.to_host();
  const std::vector<int32_t> want{0, 4, 9, 2559, 9};
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(got.get(i), want[size_t(i)]) << "row " << i;
}

TEST_P(EngineOn, BadRequestsFailAloneNamingTheRequest) {
  const Model m = Model::builtin(false);
  EngineOptions bad_opts = opts();
  bad_opts.max_slots = 4;
  bad_opts.max_batch_tokens = 256;
  bad_opts.max_context = 128;
  Engine e(m, bad_opts);
  auto req = [](std::vector<int32_t> prompt, auto edit) {
    GenerationRequest g{std::move(prompt), {}};
    g.sampling.max_new_tokens = 4;
    edit(g.sampling);
    return g;
  };
  auto none = [](SamplingParams&) {};
  e.submit(req({1, 2, 3}, none));
  e.submit(req({}, none));
  e.submit(req({1, 2560}, none));
  e.submit(req({1, 2}, [](SamplingParams& s) { s.n = 0; }));
  e.submit(req({1, 2}, [](SamplingParams& s) { s.top_p = 0; }));
  e.submit(req({1, 2}, [](SamplingParams& s) { s.top_p = 1.5; }));
  e.submit(req({1, 2}, [](SamplingParams& s) { s.temperature = -1; }));
  e.submit(req({1, 2}, [](SamplingParams& s) { s.max_new_tokens = 200; }));
  e.submit(req({1, 2}, [](SamplingParams& s) { s.n = 5; }));
  e.submit(req({4, 5, 6}, none));
  const std::vector<Completion> out = e.run();
  std::map<int64_t, std::string> errors;
  for (const Completion& c : out)
    if (c.finish_reason == "error") errors[c.request] = c.error;
    else EXPECT_EQ(c.tokens.size(), 4u);
  const std::map<int64_t, std::string> want{{1, "is empty"},      {2, "outside the vocab"}, {3, "'n': must be at least 1"},
                                            {4, "in (0, 1]"},     {5, "in (0, 1]"},        {6, "temperature"},
                                            {7, "more than a slot holds (128"}, {8, "more than the engine's 4 slots"}};
  ASSERT_EQ(errors.size(), want.size());
  for (auto& [id, what] : want) {
    EXPECT_NE(errors[id].find("request " + std::to_string(id)), std::string::npos) << errors[id];
    EXPECT_NE(errors[id].find(what), std::string::npos) << errors[id];
  }
  EXPECT_EQ(out.size(), 2u + want.size());  // requests 0 and 9 completed
}

// ---------------------------------------------------------------- sampling
TEST(Sampling, FrequenciesFollowTheTemperedSoftmax) {
  const std::vector<double> logits{1.0, -0.5, 2.0, 0.3, 0.3, -2.0, 1.1, 0.0};
  for (double T : {1.0, 0.7, 1.6}) {
    SamplingParams p;
    p.temperature = T;
    p.seed = 99;
    std::vector<int64_t> count(logits.size(), 0);
    const int64_t N = 100000;
    for (int64_t i = 0; i < N; ++i) ++count[size_t(sample_token(logits, p, 0, i))];
    double z = 0;
    std::vector<double> prob;
    for (double l : logits) z += std::exp(l / T);
    double chi2 = 0;
    for (size_t j = 0; j < logits.size(); ++j) {
      const double expected = N * std::exp(logits[j] / T) / z;
      chi2 += (double(count[j]) - expected) * (double(count[j]) - expected) / expected;
    }
    EXPECT_LT(chi2, 24.32) << "chi-square, 7 degrees of freedom, p = 0.001; T = " << T;  // a fixed seed: no flake
  }
}

// The rule's mass of the ids in `set`, written out: lane l sums ids l, l + 1024, … in turn; the
// lanes meet in a pairwise tree (recursive halving of the 1024 lane sums).
float reference_mass(const std::vector<float>& w, const std::vector<int32_t>& set) {
  std::vector<float> lanes(1024, 0.0f);
  std::vector<int32_t> asc = set;
  std::sort(asc.begin(), asc.end());
  for (int32_t i : asc) lanes[size_t(i % 1024)] += w[size_t(i)];
  for (size_t n = 512; n >= 1; n /= 2)
    for (size_t i = 0; i < n; ++i) lanes[i] = lanes[2 * i] + lanes[2 * i + 1];
  return lanes[0];
}

TEST(Sampling, TruncationKeepsExactlyTheClaimedSet) {
  Rng r(8);
  int ties_at_the_cut = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t V = trial % 3 == 0 ? r.integer(1000, 5000) : r.integer(1, 300);
    std::vector<double> logits;
    for (int64_t i = 0; i < V; ++i) logits.push_back(double(float(r.normal() * 3)));
    if (V > 4) logits[3] = logits[1];  // a tie
    if (V > 9) logits[9] = -INFINITY;  // never drawn
    SamplingParams p;
    p.temperature = r.uniform(0.3, 2.0);
    p.top_k = r.uniform(0, 1) < 0.5 ? r.integer(1, V) : 0;
    p.top_p = r.uniform(0, 1) < 0.5 ? r.uniform(0.05, 1.0) : 1.0;
    p.min_p = r.uniform(0, 1) < 0.5 ? r.uniform(0.0, 0.5) : 0.0;
    // The reference, written out: rank by (logit desc, id asc); cut k; then whole groups of equal
    // logits, largest first, until their mass reaches top_p of the mass left; keep w ≥ min_p.
    std::vector<int32_t> order;
    for (int64_t i = 0; i < V; ++i)
      if (logits[size_t(i)] > -INFINITY) order.push_back(int32_t(i));
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[size_t(a)] > logits[size_t(b)]; });
    if (p.top_k > 0 && p.top_k < int64_t(order.size())) order.resize(size_t(p.top_k));
    const float top = float(logits[size_t(order[0])]), inv_t = float(1.0 / p.temperature);
    std::vector<float> w(size_t(V), 0.0f);
    for (int32_t i : order) w[size_t(i)] = sampling_rule::weight_of(float(logits[size_t(i)]), top, inv_t);
    if (p.top_p < 1) {
      const float goal = float(p.top_p * double(reference_mass(w, order)));
      size_t keep = 0;
      while (keep < order.size()) {
        const size_t group = keep;
        while (keep < order.size() && logits[size_t(order[keep])] == logits[size_t(order[group])]) ++keep;
        if (reference_mass(w, std::vector<int32_t>(order.begin(), order.begin() + keep)) >= goal) {
          ties_at_the_cut += keep - group > 1;
          break;
        }
      }
      order.resize(keep);
    }
    std::vector<int32_t> want;
    for (int32_t i : order)
      if (p.min_p == 0 || double(w[size_t(i)]) >= p.min_p) want.push_back(i);
    std::sort(want.begin(), want.end());
    EXPECT_EQ(sampling_candidates(logits, p), want) << "trial " << trial << " V " << V;
    const int32_t tok = sample_token(logits, p, 0, trial);
    EXPECT_TRUE(std::binary_search(want.begin(), want.end(), tok)) << "drew " << tok << " outside the kept set";
    // The op's weights: the drawn token's weight and the kept set's mass, the rule's own numbers;
    // their log ratio is the token's logprob under the sampling distribution (fp64 reference).
    std::vector<float> z(logits.begin(), logits.end());
    const auto row = sampling_row(p, sampling_uniform(p.seed, 0, trial));
    int32_t drawn = -9;
    float weights[2] = {-1.0f, -1.0f};
    SampleTokensArgs a;
    a.logits = TensorView::of(z.data(), DType::f32, {1, V});
    a.params = TensorView::of(const_cast<double*>(row.data()), DType::f64, {1, sampling_rule::PARAMS});
    a.tokens = TensorView::of(&drawn, DType::i32, {1});
    a.weights = TensorView::of(weights, DType::f32, {1, 2});
    sample_tokens(Context{}, a);
    ASSERT_EQ(drawn, tok);
    const float mass = reference_mass(w, want);
    EXPECT_EQ(std::memcmp(&weights[0], &w[size_t(tok)], 4), 0) << "trial " << trial;
    EXPECT_EQ(std::memcmp(&weights[1], &mass, 4), 0) << "trial " << trial;
    double z64 = 0;
    for (int32_t i : want) z64 += std::exp((logits[size_t(i)] - double(top)) / p.temperature);
    const double truth = (logits[size_t(tok)] - double(top)) / p.temperature - std::log(z64);
    EXPECT_NEAR(sampling_rule::sampling_logprob(weights[0], weights[1]), truth, 1e-5 + 1e-6 * std::fabs(truth))
        << "trial " << trial;
    if (trial % 50 == 0) {  // greedy: {1, 1}, a logprob of 0
      std::array<double, sampling_rule::PARAMS> g = row;
      g[0] = 0.0;
      a.params = TensorView::of(g.data(), DType::f64, {1, sampling_rule::PARAMS});
      sample_tokens(Context{}, a);
      EXPECT_TRUE(weights[0] == 1.0f && weights[1] == 1.0f) << "greedy, trial " << trial;
      EXPECT_EQ(sampling_rule::sampling_logprob(weights[0], weights[1]), 0.0);
    }
  }
  EXPECT_GT(ties_at_the_cut, 0) << "no trial put a tie at the top-p cut";
}

TEST(Sampling, ExtremeSettingsAndValuesAreDrawnOrNamed) {
  const std::vector<double> logits{1.0, 2.0, 3.0};
  SamplingParams p;
  p.temperature = 1e301;  // finite: accepted by validate, so by the kernels (every weight 1)
  EXPECT_NO_THROW(sample_token(logits, p, 0, 0));
  p.temperature = 1e-40;  // 1/T overflows fp32: the max alone can be drawn
  for (int64_t i = 0; i < 20; ++i) EXPECT_EQ(sample_token(logits, p, 0, i), 2);
  p.temperature = 1.0;
  try {
    sample_token({1.0, 1e39, 0.0}, p, 0, 0);
    ADD_FAILURE() << "a logit past fp32's range was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp32's range"), std::string::npos) << e.what();
  }
  // The kernels index ids in 32 bits: a vocab past that is refused before anything is read.
  float z = 0;
  double params[5] = {1, 0, 1, 0, 0.5};
  int32_t token = 0;
  SampleTokensArgs a;
  a.logits = TensorView::of(&z, DType::f32, {1, int64_t(INT32_MAX)});
  a.params = TensorView::of(params, DType::f64, {1, 5});
  a.tokens = TensorView::of(&token, DType::i32, {1});
  try {
    sample_tokens(Context{}, a);
    ADD_FAILURE() << "a vocab of 2^31 - 1 ids was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab of more than"), std::string::npos) << e.what();
  }
}

TEST_P(EngineOn, TheSameSeedDrawsTheSameTokensAndAnotherDoesNot) {
  const Model m = Model::builtin(false);
  GenerationRequest g = target_request();
  g.sampling.n = 1;
  const auto a = generate(m, {g}, opts()), b = generate(m, {g}, opts());
  g.sampling.seed += 1;
  const auto c = generate(m, {g}, opts());
  EXPECT_EQ(a[0].tokens, b[0].tokens);
  EXPECT_NE(a[0].tokens, c[0].tokens);
  EXPECT_EQ(sampling_uniform(1, 2, 3), sampling_uniform(1, 2, 3));
  EXPECT_NE(sampling_uniform(1, 2, 3), sampling_uniform(1, 3, 2));
  EXPECT_NE(sampling_uniform(1, 2, 3), sampling_uniform(2, 2, 3));
}

TEST(EngineGraphs, EveryBatchSizeHasABucketThatHoldsIt) {
  const std::map<int64_t, int64_t> want = {{1, 1},   {2, 2},   {3, 4},   {5, 8},   {8, 8},     {9, 16},   {17, 24},
                                           {63, 64}, {64, 64}, {65, 96}, {250, 256}, {257, 320}, {500, 512}};
  for (auto [n, b] : want) EXPECT_EQ(DecodeGraphs::bucket_of(n, 512), b) << n << " sequences";
  EXPECT_EQ(DecodeGraphs::bucket_of(5, 6), 6) << "never past the most sequences";
  for (int64_t n = 1; n <= 600; ++n) EXPECT_GE(DecodeGraphs::bucket_of(n, 600), n);
}

// The proof that graphs change no bit: the same requests with decode steps replayed from graphs and
// run eagerly give the same tokens and logprobs, while batch sizes shrink through several buckets
// and one prompt's samples cross 1024 keys (where a decode's keys split into two spans and the
// captured combine kernel switches on).
TEST(EngineGraphs, DecodeStepsReplayedFromGraphsGiveTheEagerBits) {
  if (!cuda_device_present() || !captured_graphs_available(Backend::cuda)) GTEST_SKIP() << "no CUDA graphs here";
  const Model m = Model::builtin(false);
  std::vector<GenerationRequest> reqs = others(10, 21);
  reqs.push_back(sampled_request(22, 1010, 2, 0.8, 0, 0.9, 30, 99));  // its samples cross 1024 keys
  reqs.push_back(target_request());
  auto run = [&](bool graphs, int64_t* graph_steps, int64_t* captured) {
    EngineOptions o;
    o.backend = Backend::cuda;
    o.cuda_graphs = graphs;
    o.page_size = 16;
    Engine e(m, o);
    for (auto& q : reqs) e.submit(q);
    std::vector<Completion> got = e.run();
    *graph_steps = e.graph_steps();
    *captured = e.captured_graphs();
    return got;
  };
  int64_t eager_steps = 0, eager_graphs = 0, graph_steps = 0, graphs = 0;
  const std::vector<Completion> eager = run(false, &eager_steps, &eager_graphs);
  const std::vector<Completion> replayed = run(true, &graph_steps, &graphs);
  EXPECT_EQ(eager_steps, 0);
  EXPECT_GT(graph_steps, 20) << "decode steps should replay graphs";
  EXPECT_GE(graphs, 3) << "the batch shrinks through several buckets";
  expect_same(replayed, eager, "graphs vs eager");
  for (auto& c : replayed) EXPECT_NE(c.finish_reason, "error") << c.error;
}

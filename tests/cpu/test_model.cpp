// The model: config parsing, safetensors loading (and its refusals), export round trips, and the
// chain's gradients against finite differences of its own fp64 forward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "samebits/chain.hpp"
#include "samebits/chain_gate.hpp"
#include "samebits/error.hpp"
#include "samebits/model.hpp"
#include "tests/model_test_util.hpp"
#include "tools/logprobs_io.hpp"

using namespace samebits;
namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("samebits_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void spit(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

std::vector<double> logprobs(const Model& m, const std::vector<std::vector<int32_t>>& seqs) {
  return Chain(m, Context{}).forward(ChainBatch::packed(seqs)).logp;
}

const std::vector<std::vector<int32_t>> kSeqs = {{5, 17, 2000, 3, 9, 44}, {1, 2, 3}, {2559, 0, 7, 7, 7}};

// Expects Model::load(dir) to throw an Error whose text mentions `what`.
void expect_load_error(const fs::path& dir, const std::string& what) {
  try {
    Model::load(dir.string());
    ADD_FAILURE() << "no error; expected one mentioning: " << what;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

// A small safetensors file: header JSON + payload.
std::string safetensors_bytes(const std::string& header, const std::string& payload) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((uint64_t(header.size()) >> (8 * i)) & 0xff);
  return out + header + payload;
}

}  // namespace

TEST(Model, ExportThenLoadGivesBitIdenticalLogprobs) {
  for (bool tied : {false, true}) {
    const Model m = Model::builtin(tied);
    const fs::path dir = scratch(tied ? "tied" : "untied");
    m.save(dir.string());
    const Model back = Model::load(dir.string());
    EXPECT_EQ(back.config().tie_word_embeddings, tied);
    EXPECT_EQ(back.has("lm_head.weight"), !tied);
    const auto a = logprobs(m, kSeqs), b = logprobs(back, kSeqs);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)), 0);
    fs::remove_all(dir);
  }
}

TEST(Model, ShardedCheckpointsLoad) {
  const Model m = Model::builtin(false);
  const fs::path dir = scratch("sharded");
  m.save(dir.string());
  // Re-split model.safetensors into two shards with an index, as Hugging Face writes them.
  const Model whole = Model::load(dir.string());
  nlohmann::json index;
  std::vector<std::pair<std::string, TensorView>> shard[2];
  int k = 0;
  for (auto& [name, shape] : m.config().expected_tensors()) {
    const std::string file = fmt::format("model-0000{}-of-00002.safetensors", k % 2 + 1);
    index["weight_map"][name] = file;
    shard[k % 2].push_back({name, whole.weight(name)});
    ++k;
  }
  fs::remove(dir / "model.safetensors");
  for (int s = 0; s < 2; ++s) {
    nlohmann::json h;
    uint64_t off = 0;
    std::string payload;
    for (auto& [name, t] : shard[s]) {
      h[name] = {{"dtype", "BF16"}, {"shape", std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim)},
                 {"data_offsets", {off, off + uint64_t(t.bytes())}}};
      payload.append(static_cast<const char*>(t.data), size_t(t.bytes()));
      off += uint64_t(t.bytes());
    }
    spit(dir / fmt::format("model-0000{}-of-00002.safetensors", s + 1), safetensors_bytes(h.dump(), payload));
  }
  spit(dir / "model.safetensors.index.json", index.dump());
  const auto a = logprobs(m, kSeqs), b = logprobs(Model::load(dir.string()), kSeqs);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)), 0);  // also: odd header sizes
  fs::remove_all(dir);
}

TEST(Model, MalformedSafetensorsAreRejectedWithClearErrors) {
  const fs::path dir = scratch("malformed");
  Model::builtin(false).save(dir.string());
  const std::string good = slurp(dir / "model.safetensors");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(good[size_t(i)]);
  const nlohmann::json header = nlohmann::json::parse(good.substr(8, n));
  const std::string payload = good.substr(8 + n);
  auto with_header = [&](const nlohmann::json& h) { spit(dir / "model.safetensors", safetensors_bytes(h.dump(), payload)); };
  const std::string name = "model.layers.0.mlp.up_proj.weight";

  spit(dir / "model.safetensors", good.substr(0, good.size() / 2));
  expect_load_error(dir, "past the data section");  // truncated data
  spit(dir / "model.safetensors", good.substr(0, 5));
  expect_load_error(dir, "truncated");
  spit(dir / "model.safetensors", good.substr(0, 8 + n / 2));
  expect_load_error(dir, "truncated");
  spit(dir / "model.safetensors", safetensors_bytes("{not json", payload));
  expect_load_error(dir, "not valid JSON");

  auto h = header;
  h[name]["data_offsets"][1] = h[name]["data_offsets"][1].get<uint64_t>() + (1ull << 40);
  with_header(h);
  expect_load_error(dir, "past the data section");
  h = header;
  h[name]["data_offsets"] = {10, 2};
  with_header(h);
  expect_load_error(dir, "reversed");
  h = header;  // move one tensor onto another: same size, overlapping bytes
  h[name]["data_offsets"] = h["model.layers.0.mlp.gate_proj.weight"]["data_offsets"];
  with_header(h);
  expect_load_error(dir, "overlap");
  h = header;
  h[name]["dtype"] = "F32";
  with_header(h);
  expect_load_error(dir, "need");  // byte count no longer matches shape × dtype
  h = header;
  h[name]["dtype"] = "I8";
  with_header(h);
  expect_load_error(dir, "unsupported dtype 'I8'");
  h = header;
  h.erase(name);
  with_header(h);
  expect_load_error(dir, "missing tensor");
  h = header;
  h["model.layers.9.mlp.up_proj.weight"] = h[name];
  h["model.layers.9.mlp.up_proj.weight"]["data_offsets"] = {0, 0};
  h["model.layers.9.mlp.up_proj.weight"]["shape"] = {0};
  with_header(h);
  expect_load_error(dir, "unexpected tensor");
  h = header;
  h[name]["shape"] = {h[name]["shape"][1], h[name]["shape"][0]};
  with_header(h);
  expect_load_error(dir, "does not match the config");

  // A whole-tensor dtype mismatch against torch_dtype: an fp32 checkpoint declared bfloat16.
  spit(dir / "model.safetensors", good);
  const Model f32 = Model::builtin(false).converted(DType::f32);
  f32.save((dir / "f32").string());
  fs::copy_file(dir / "f32" / "model.safetensors", dir / "model.safetensors", fs::copy_options::overwrite_existing);
  expect_load_error(dir, "does not match the config's torch_dtype");
  fs::remove_all(dir);
}

TEST(Model, BadConfigsAreRejected) {
  const std::string base = Model::builtin(false).config().to_json();
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    auto j = nlohmann::json::parse(base);
    if (value.is_null()) j.erase(key); else j[key] = value;
    return j.dump();
  };
  struct Bad { std::string key; nlohmann::json value; std::string what; };
  for (const Bad& b : std::vector<Bad>{{"num_key_value_heads", 3, "does not divide"},
                                       {"hidden_size", -4, "outside"},
                                       {"vocab_size", nullptr, "is missing"},
                                       {"model_type", "mixtral", "unsupported architecture"},
                                       {"hidden_act", "gelu", "silu only"},
                                       {"rms_norm_eps", 0, "must be in (0, 1)"},
                                       {"head_dim", 7, "even"},
                                       {"torch_dtype", "int8", "not supported"},
                                       {"num_hidden_layers", "two", "must be an integer"}}) {
    SCOPED_TRACE(b.key);
    auto text = with(b.key, b.value);
    if (b.key == "model_type") {  // the architecture is read from model_type or architectures
      auto j = nlohmann::json::parse(text);
      j["architectures"] = {"MixtralForCausalLM"};
      text = j.dump();
    }
    try {
      ModelConfig::from_json(text);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.what), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(ModelConfig::from_json("[1, 2]"), Error);
  EXPECT_THROW(ModelConfig::from_json("{"), Error);
  auto j = nlohmann::json::parse(base);
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4}};
  EXPECT_THROW(ModelConfig::from_json(j.dump()), Error);
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  j["model_type"] = "llama";
  j["architectures"] = {"LlamaForCausalLM"};
  const ModelConfig llama = ModelConfig::from_json(j.dump());
  EXPECT_TRUE(llama.rope.llama3_scaling);
  EXPECT_FALSE(llama.qk_norm);
  // transformers 5: one rope_parameters object (theta and type), "default" meaning no scaling.
  auto v5 = nlohmann::json::parse(base);
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 123456.0}};
  const ModelConfig plain = ModelConfig::from_json(v5.dump());
  EXPECT_EQ(plain.rope.theta, 123456.0);
  EXPECT_FALSE(plain.rope.llama3_scaling);
  v5["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  const ModelConfig scaled = ModelConfig::from_json(v5.dump());
  EXPECT_EQ(scaled.rope.theta, 500000.0);
  EXPECT_TRUE(scaled.rope.llama3_scaling);
  v5["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0}};
  EXPECT_THROW(ModelConfig::from_json(v5.dump()), Error);
}

TEST(Model, ChainRejectsBadBatches) {
  const Model m = Model::builtin(false);
  const Chain chain(m, Context{});
  auto expect = [&](const ChainBatch& b, const std::string& what) {
    try {
      chain.forward(b);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect(ChainBatch{}, "empty batch");
  ChainBatch b = ChainBatch::packed({{1, 2, 3}});
  b.tokens[1] = 2560;
  expect(b, "outside [0, 2560)");
  b = ChainBatch::packed({{1, 2, 3}});
  b.tokens[1] = -3;
  expect(b, "outside [0, 2560)");
  b = ChainBatch::packed({{1, 2, 3}});
  b.seqs[0].len = 0;
  expect(b, "zero-length");
  b = ChainBatch::packed({{1, 2, 3}});
  b.positions[2] = -1;
  expect(b, "positions");
}

TEST(Model, LogprobsJsonlRejectsBadLinesAndScoresGoodOnes) {
  const Model m = Model::builtin(false);
  std::stringstream ok("{\"tokens\": [1, 2, 3]}\n\n{\"tokens\": [4, 5], \"loss_mask\": [1, 0]}\n"), out;
  tools::write_logprobs(m, Backend::cpu, ok, out, true);
  std::string line;
  std::getline(out, line);
  auto j = nlohmann::json::parse(line);
  EXPECT_TRUE(j["logprobs"][0].is_null());
  EXPECT_EQ(j["logprobs"].size(), 3u);
  EXPECT_EQ(j["entropy"].size(), 3u);
  const auto direct = logprobs(m, {{1, 2, 3}});
  EXPECT_EQ(j["logprobs"][1].get<float>(), float(direct[0]));
  std::getline(out, line);
  EXPECT_TRUE(nlohmann::json::parse(line)["logprobs"][1].is_null());  // masked
  for (auto [text, what] : std::vector<std::pair<std::string, std::string>>{
           {"{\"tokens\": [1, 99999]}", "token id 99999 is outside the vocab"},
           {"{\"tokens\": [1, -1]}", "outside the vocab"},
           {"{\"tokens\": [1.5]}", "integers"},
           {"{\"tokens\": []}", "zero-length"},
           {"{\"toks\": [1]}", "\"tokens\" array"},
           {"not json", "not valid JSON"},
           {"{\"tokens\": [1, 2], \"loss_mask\": [1]}", "one 0/1 per token"}}) {
    std::stringstream in(text), sink;
    try {
      tools::write_logprobs(m, Backend::cpu, in, sink, false);
      ADD_FAILURE() << "accepted " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

TEST(Model, GradientsFileHoldsTheChainsGradientsWhateverTheMicroBatch) {
  const Model m = Model::builtin(true);
  const std::string text = "{\"tokens\": [1, 2, 3, 4]}\n{\"tokens\": [5, 6, 7], \"loss_mask\": [0, 1, 0]}\n{\"tokens\": [8, 9]}\n";
  const fs::path dir = scratch("grads_file");
  fs::create_directories(dir);
  int64_t scored[2];
  for (int mb : {16, 1}) {
    std::stringstream in(text);
    scored[mb == 1] = tools::write_gradients(m, Backend::cpu, in, (dir / fmt::format("g{}.safetensors", mb)).string(), mb);
  }
  EXPECT_EQ(scored[0], 3 + 1 + 1);
  EXPECT_EQ(scored[0], scored[1]);
  auto bytes = [&](const std::string& f) {
    std::ifstream in(dir / f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes("g16.safetensors"), bytes("g1.safetensors")) << "the micro-batch size changed the gradient bits";
  // The file holds what a direct backward gives (dlogp = 1 on every scored row).
  const Chain chain(m, Context{});
  ChainBatch b = ChainBatch::packed({{1, 2, 3, 4}, {5, 6, 7}, {8, 9}});
  b.loss_mask[size_t(b.seqs[1].row + 1)] = 0;  // loss_mask [0, 1, 0]: 6 is scored (row 0), 7 is not (row 1)
  std::vector<double> dl(size_t(b.rows()), 0.0);
  for (size_t i = 0; i < dl.size(); ++i) dl[i] = b.loss_mask[i];
  ModelGrads g(m, DType::f32);
  chain.backward(b, chain.forward(b), dl, g);
  const std::string file = bytes("g16.safetensors");
  const harness::HostTensor want = g.gradient("model.embed_tokens.weight");
  EXPECT_NE(file.find(std::string(static_cast<const char*>(want.data()), want.bytes())), std::string::npos)
      << "the embedding gradient (the tied sum) is not in the file";
  fs::remove_all(dir);
}

TEST(Model, ChainGradientsMatchFiniteDifferences) {
  // A tiny model in fp64 truth mode: L = Σ dlogp·logp; every weight's gradient at a few elements.
  for (bool tied : {false, true}) {
    ModelConfig c = Model::builtin(tied).config();
    c.vocab_size = 300;
    c.hidden_size = 16;
    c.intermediate_size = 24;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    const Model wide = Model::random(c, 3).widened();
    Context truth;
    truth.precision = Precision::truth_fp64;
    const Chain chain(wide, truth);
    const ChainBatch b = ChainBatch::padded({{5, 17, 200, 3, 9}, {1, 2, 299}}, 6, true, 1, 4);
    std::vector<double> dlogp(size_t(b.rows()));
    harness::Rng r(9);
    for (auto& d : dlogp) d = r.uniform(-1, 1);
    ModelGrads grads(wide, DType::f64);
    chain.backward(b, chain.forward(b), dlogp, grads);
    auto loss = [&] {
      const auto f = chain.forward(b);
      double l = 0;
      for (size_t i = 0; i < dlogp.size(); ++i) l += dlogp[i] * f.logp[i];
      return l;
    };
    for (auto& name : grads.names()) {
      auto* w = static_cast<double*>(wide.weight(name).data);
      const harness::HostTensor g = grads.gradient(name);
      for (int k = 0; k < 3; ++k) {
        const int64_t i = r.integer(0, g.numel() - 1);
        const double saved = w[i], h = 1e-6;
        w[i] = saved + h;
        const double lp = loss();
        w[i] = saved - h;
        const double lm = loss();
        w[i] = saved;
        const double fd = (lp - lm) / (2 * h);
        EXPECT_NEAR(g.get(i), fd, 1e-6 + 1e-5 * std::fabs(fd)) << (tied ? "tied " : "untied ") << name << " at " << i;
      }
    }
  }
}

TEST(Model, ChainGatePassesOnLlamaAndFp16Models) {
  // Llama-3 (no QK-norm, rope scaling, untied) in bf16, and a Qwen3 model in fp16, each exported
  // and loaded back through the Hugging Face format first.
  const ModelConfig llama = testing_model::builtin_llama_config();
  ModelConfig fp16 = Model::builtin(true).config();
  fp16.dtype = DType::f16;
  for (const ModelConfig& c : {llama, fp16}) {
    const fs::path dir = scratch("gate_" + c.architecture + dtype_name(c.dtype));
    Model::random(c, 21).save(dir.string());
    const Model m = Model::load(dir.string());
    harness::ChainGateOptions opt;
    opt.target_len = 70;
    opt.chunk_sizes = {1, 7, 64};
    const harness::CaseResult r = harness::run_chain_gate(m, c.architecture, harness::Contract::builtin(), opt);
    for (const harness::CellResult* cell : {&r.fwd_invariance, &r.fwd_accuracy, &r.bwd_invariance, &r.bwd_accuracy}) {
      EXPECT_EQ(cell->status, harness::Status::pass) << c.architecture << " " << dtype_name(c.dtype) << " " << cell->note;
      for (auto& d : cell->drifts)
        if (d.count) ADD_FAILURE() << d.message();
    }
    fs::remove_all(dir);
  }
}

TEST(Model, PagedCacheWithPaddingRowsHoldsTheContiguousBits) {
  // Qwen3 (the keys and values written by the QK-norm pair's launch) and Llama-3 (by an indexed
  // copy): two sequences in two slots with a padding row between them, a prefill chunk then decode
  // steps, against a paged cache and a contiguous one: the same logprobs bit for bit (a padding row
  // writing a cache row — page 0 holds slot 0's tokens — would change them).
  for (const ModelConfig& c : {Model::builtin(false).config(), testing_model::builtin_llama_config()}) {
    const Model m = Model::random(c, 33);
    const Chain chain(m, Context{});
    KvCache flat(c, 2, 32, chain.act_dtype()), paged = KvCache::paged(c, 2, 32, 8, 8, chain.act_dtype());
    std::vector<double> got[2];
    for (KvCache* cache : {&flat, &paged}) {
      int64_t at = 0;
      for (int64_t len : {5, 1, 1}) {
        ChainBatch b;  // rows: sequence 0 (slot 1), a padding row, sequence 1 (slot 0)
        for (int64_t s = 0; s < 2; ++s) {
          if (s == 1) b.tokens.push_back(3), b.positions.push_back(0), b.targets.push_back(-100), b.loss_mask.push_back(0);
          b.seqs.push_back({int64_t(b.tokens.size()), len, 1 - s, at});
          for (int64_t i = 0; i < len; ++i) {
            b.tokens.push_back(int32_t(7 + 5 * s + 3 * (at + i)));
            b.positions.push_back(int32_t(at + i));
            b.targets.push_back(int32_t(2 + s + at + i));
            b.loss_mask.push_back(1);
          }
        }
        for (int64_t s = 0; s < 2; ++s) ASSERT_TRUE(cache->reserve(s, at + len));
        const ChainForward f = chain.forward_cached(b, *cache);
        for (int64_t r = 0; r < b.rows(); ++r)
          if (b.loss_mask[size_t(r)]) got[cache == &paged].push_back(f.logp[size_t(r)]);
        at += len;
      }
    }
    ASSERT_EQ(got[0].size(), 2u * 7u) << c.architecture;
    EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(double)), 0) << c.architecture;
  }
}

TEST(Model, TiedGradientIsTheUntiedAccumulatorsSummedOnce) {
  // The same weights as a tied model and as an untied one whose LM head is a copy of the embedding:
  // the same logprobs bit for bit, and the tied matrix's gradient is exactly the untied run's
  // embedding accumulator + its LM-head accumulator (one fp32 add per element, the documented order).
  ModelConfig c = Model::builtin(true).config();
  c.vocab_size = 300;
  const Model tied = Model::random(c, 5);
  c.tie_word_embeddings = false;
  const Model untied = Model::random(c, 6);
  for (auto& [name, w] : tied.weights()) std::memcpy(untied.weight(name).data, w.data, size_t(w.bytes()));
  const TensorView& embed = tied.weight("model.embed_tokens.weight");
  std::memcpy(untied.weight("lm_head.weight").data, embed.data, size_t(embed.bytes()));
  const ChainBatch b = ChainBatch::packed({{5, 17, 200, 3, 9}, {1, 2, 299}});
  std::vector<double> dlogp(size_t(b.rows()));
  harness::Rng r(9);
  for (auto& d : dlogp) d = r.uniform(-1, 1);
  const Chain ct(tied, Context{}), cu(untied, Context{});
  const ChainForward ft = ct.forward(b), fu = cu.forward(b);
  ASSERT_EQ(ft.logp.size(), fu.logp.size());
  EXPECT_EQ(std::memcmp(ft.logp.data(), fu.logp.data(), ft.logp.size() * sizeof(double)), 0) << "logp";
  ModelGrads gt(tied, DType::f32), gu(untied, DType::f32);
  ct.backward(b, ft, dlogp, gt);
  cu.backward(b, fu, dlogp, gu);
  const harness::HostTensor g = gt.gradient("model.embed_tokens.weight");
  const harness::HostTensor e = gu.accumulator("model.embed_tokens.weight").to_host();
  const harness::HostTensor h = gu.accumulator("lm_head.weight").to_host();
  harness::HostTensor sum(DType::f32, e.shape());
  for (int64_t i = 0; i < e.numel(); ++i) sum.set(i, double(float(e.get(i)) + float(h.get(i))));
  ASSERT_EQ(g.bytes(), sum.bytes());
  EXPECT_EQ(std::memcmp(g.data(), sum.data(), g.bytes()), 0) << "tied gradient vs untied embedding + LM head";
  for (auto& name : gu.names()) {
    if (name == "model.embed_tokens.weight" || name == "lm_head.weight") continue;
    const harness::HostTensor a = gt.gradient(name), bb = gu.gradient(name);
    EXPECT_EQ(std::memcmp(a.data(), bb.data(), a.bytes()), 0) << name;
  }
}

TEST(Model, ActivationsNeedNoPoisonOnTheCpu) {
  testing_model::expect_poisoning_changes_no_bit(Model::builtin(true), Backend::cpu);
}

TEST(Model, ActivationsFileHoldsEveryActivationOfTheForward) {
  const Model m = Model::builtin(false);
  const fs::path dir = scratch("activations_file");
  fs::create_directories(dir);
  const std::string path = (dir / "a.safetensors").string();
  std::stringstream in("{\"tokens\": [1, 2, 3, 4]}\n{\"tokens\": [5, 6, 7]}\n");
  EXPECT_EQ(tools::write_activations(m, Backend::cpu, in, path), 7);
  std::ifstream file(path, std::ios::binary);
  const std::string bytes(std::istreambuf_iterator<char>(file), {});
  const ChainForward f = Chain(m, Context{}).forward(ChainBatch::packed({{1, 2, 3, 4}, {5, 6, 7}}));
  for (const auto& [name, t] : f.trace) {
    EXPECT_NE(bytes.find("\"" + name + "\""), std::string::npos) << name << " is not in the header";
    const harness::HostTensor host = t.to_host();
    EXPECT_NE(bytes.find(std::string(static_cast<const char*>(host.data()), host.bytes())), std::string::npos)
        << name << ": the file does not hold the forward's bits";
  }
  std::stringstream none("");
  EXPECT_THROW(tools::write_activations(m, Backend::cpu, none, path), Error);
  fs::remove_all(dir);
}

TEST(Model, ScoringKeepsNoActivationsAndGivesTheForwardsBits) {
  // Chain::score: forward()'s logprobs and entropies, bit for bit, with each layer's activations
  // freed as the next begins (the trace ends with the final norm's rows alone); a backward refuses it.
  for (bool tied : {false, true}) {
    const Model m = Model::builtin(tied);
    const Chain chain(m, Context{});
    const ChainBatch b = ChainBatch::packed({{1, 2, 3, 4, 5, 6, 7, 8}, {9, 10, 11}, {12, 13, 14, 15, 16}});
    const ChainForward full = chain.forward(b), scored = chain.score(b);
    ASSERT_EQ(scored.logp.size(), full.logp.size());
    EXPECT_EQ(std::memcmp(scored.logp.data(), full.logp.data(), full.logp.size() * sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(scored.entropy.data(), full.entropy.data(), full.entropy.size() * sizeof(double)), 0);
    EXPECT_TRUE(full.activations_kept());
    EXPECT_FALSE(scored.activations_kept());
    EXPECT_LT(scored.trace.size() * 4, full.trace.size()) << "scoring kept " << scored.trace.size() << " of "
                                                          << full.trace.size() << " activations";
    for (const auto& [name, t] : scored.trace) EXPECT_EQ(name.rfind("layer", 0), std::string::npos) << name;
    ModelGrads g(m, DType::f32);
    try {
      chain.backward(b, scored, std::vector<double>(size_t(b.rows()), 1.0), g);
      ADD_FAILURE() << "a backward took a forward without activations";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("kept no activations"), std::string::npos) << e.what();
    }
  }
}

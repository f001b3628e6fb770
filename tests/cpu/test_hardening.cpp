// Hostile and broken inputs, in process: deep JSON, bounded error quotes, config values that
// nlohmann would silently coerce, limits checked before any work, named NaN weights, output that
// cannot be written, and the command-line parser's messages. (tests/cli runs the `samebits`
// command itself over the same classes and checks exit codes.)
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "samebits/chain.hpp"
#include "samebits/error.hpp"
#include "samebits/model.hpp"
#include "src/core/json_text.hpp"
#include "src/core/output_file.hpp"
#include "tools/cli.hpp"
#include "tools/logprobs_io.hpp"

using namespace samebits;
namespace fs = std::filesystem;

namespace {

// The text of the samebits::Error `f` throws ("" and a test failure if it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no samebits::Error";
  return "";
}

#define EXPECT_MENTIONS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

std::string nested(int depth) { return std::string(size_t(depth), '[') + std::string(size_t(depth), ']'); }

std::string config_with(const std::string& key, const nlohmann::json& value) {
  auto j = nlohmann::json::parse(Model::builtin(false).config().to_json());
  j[key] = value;
  return j.dump();
}

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("samebits_hardening_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

}  // namespace

TEST(Hardening, DeeplyNestedJsonIsRefusedNotACrash) {
  // 100000 levels crashed the process when the error path dumped the value (SIGSEGV).
  std::string config = config_with("hidden_act", "silu");
  config.replace(config.find("\"silu\""), 6, nested(100000));
  EXPECT_MENTIONS(error_of([&] { ModelConfig::from_json(config); }), "nests deeper than 64 levels");
  std::istringstream line("{\"tokens\": " + nested(100000) + "}\n");
  EXPECT_MENTIONS(error_of([&] { tools::read_sequences(line, Model::builtin(false).config(), "logprobs"); }),
                  "line 1': is not accepted: its JSON nests deeper than 64 levels");
  // Nesting within the bound is parsed as usual (and refused for what it is).
  std::istringstream shallow("{\"tokens\": [" + nested(40) + "]}\n");
  EXPECT_MENTIONS(error_of([&] { tools::read_sequences(shallow, Model::builtin(false).config(), "logprobs"); }),
                  "token ids must be integers");
}

TEST(Hardening, ErrorsQuoteABoundedPartOfABadValue) {
  const std::string big(20000, 'x');
  const std::string e1 = error_of([&] { ModelConfig::from_json(config_with("num_hidden_layers", big)); });
  EXPECT_MENTIONS(e1, "must be an integer");
  EXPECT_MENTIONS(e1, "a string of 20000 bytes");
  EXPECT_LT(e1.size(), 300u);
  nlohmann::json arr = nlohmann::json::array();
  for (int i = 0; i < 5000; ++i) arr.push_back(i);
  const std::string e2 = error_of([&] { ModelConfig::from_json(config_with("hidden_size", arr)); });
  EXPECT_MENTIONS(e2, "an array of 5000 values");
  EXPECT_LT(e2.size(), 300u);
  std::istringstream line("{\"tokens\": [1, {\"a\": \"" + big + "\"}]}\n");
  const std::string e3 = error_of([&] { tools::read_sequences(line, Model::builtin(false).config(), "logprobs"); });
  EXPECT_MENTIONS(e3, "token ids must be integers");
  EXPECT_LT(e3.size(), 300u);
  EXPECT_EQ(quote_json(nlohmann::json(64.9)), "64.9");
  EXPECT_EQ(quote_json(nlohmann::json::parse("[1, 2]")), "[1, 2]");
}

TEST(Hardening, ConfigSizesMustBeIntegersAndTheArchitectureConsistent) {
  EXPECT_MENTIONS(error_of([&] { ModelConfig::from_json(config_with("hidden_size", 64.9)); }),
                  "'hidden_size': must be an integer, got 64.9");
  EXPECT_MENTIONS(error_of([&] { ModelConfig::from_json(config_with("num_attention_heads", 4.0)); }),
                  "must be an integer");
  EXPECT_MENTIONS(error_of([&] { ModelConfig::from_json(config_with("tie_word_embeddings", 1)); }),
                  "must be true or false");
  // A Mistral model_type with a Qwen3 class name was taken as Qwen3.
  auto mixed = nlohmann::json::parse(config_with("model_type", "mistral"));
  EXPECT_MENTIONS(error_of([&] { ModelConfig::from_json(mixed.dump()); }),
                  "'mistral' disagrees with architectures ['Qwen3ForCausalLM']");
  mixed["model_type"] = "llama";
  EXPECT_MENTIONS(error_of([&] { ModelConfig::from_json(mixed.dump()); }), "disagrees");
  // Either one alone still names the model.
  auto only_type = nlohmann::json::parse(config_with("model_type", "qwen3"));
  only_type.erase("architectures");
  EXPECT_EQ(ModelConfig::from_json(only_type.dump()).architecture, "qwen3");
  auto only_arch = nlohmann::json::parse(config_with("architectures", {"LlamaForCausalLM"}));
  only_arch.erase("model_type");
  EXPECT_EQ(ModelConfig::from_json(only_arch.dump()).architecture, "llama");
}

TEST(Hardening, SequencesPastMaxPositionAreRefusedBeforeAnyWork) {
  ModelConfig c = Model::builtin(false).config();
  c.rope.max_position = 8;
  const Model m = Model::random(c, 7);
  std::istringstream in("{\"tokens\": [1, 2, 3]}\n{\"tokens\": [1, 2, 3, 4, 5, 6, 7, 8, 9]}\n");
  EXPECT_MENTIONS(error_of([&] { tools::read_sequences(in, c, "logprobs"); }),
                  "'line 2': 9 tokens, more than the model's max_position_embeddings (8)");
  // The chain itself refuses it with the limit named (not a kernel's "argument 'positions'").
  EXPECT_MENTIONS(error_of([&] { Chain(m, Context{}).forward(ChainBatch::packed({{1, 2, 3, 4, 5, 6, 7, 8, 9}})); }),
                  "position 8 at row 8 is past the model's max_position_embeddings (8)");
  EXPECT_NO_THROW(Chain(m, Context{}).forward(ChainBatch::packed({{1, 2, 3, 4, 5, 6, 7, 8}})));
}

TEST(Hardening, JsonlLossMaskAndEmptyInputs) {
  const ModelConfig c = Model::builtin(false).config();
  std::istringstream seven("{\"tokens\": [1, 2], \"loss_mask\": [1, 7]}\n");
  EXPECT_MENTIONS(error_of([&] { tools::read_sequences(seven, c, "logprobs"); }), "loss_mask entries must be 0 or 1, got 7");
  for (const char* text : {"", "\n  \n\t\n"}) {
    std::istringstream empty(text);
    EXPECT_MENTIONS(error_of([&] { tools::read_sequences(empty, c, "grads"); }), "holds no sequences");
  }
  // grads on empty input wrote all-zero gradients and succeeded; now it is an error like activations'.
  const fs::path dir = scratch("empty");
  std::istringstream none("");
  EXPECT_MENTIONS(error_of([&] { tools::write_gradients(Model::builtin(false), Backend::cpu, none, (dir / "g").string()); }),
                  "holds no sequences");
  EXPECT_FALSE(fs::exists(dir / "g"));
  fs::remove_all(dir);
}

TEST(Hardening, ANonFiniteWeightIsNamed) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    const Model m = Model::builtin(false).converted(DType::f32);
    auto* w = static_cast<float*>(const_cast<void*>(m.weight("model.layers.1.mlp.up_proj.weight").data));
    w[17] = bad;
    EXPECT_MENTIONS(error_of([&] { Chain(m, Context{}); }),
                    "'model.layers.1.mlp.up_proj.weight': this model weight holds a non-finite value (NaN or Inf) at "
                    "flat index 17");
  }
}

TEST(Hardening, ABackwardRefusesAnotherChainsForward) {
  const Model a = Model::builtin(false, 1), b = Model::builtin(false, 2);  // same shape
  const Chain ca(a, Context{}), cb(b, Context{});
  const ChainBatch batch = ChainBatch::packed({{1, 2, 3, 4}});
  const ChainForward f = ca.forward(batch);
  ModelGrads g(b, DType::f32);
  EXPECT_MENTIONS(error_of([&] { cb.backward(batch, f, std::vector<double>(4, 1.0), g); }),
                  "was made by a chain over another model");
  ModelGrads ga(a, DType::f32);
  EXPECT_MENTIONS(error_of([&] { ca.backward(ChainBatch::packed({{1, 2, 3}}), f, std::vector<double>(3, 1.0), ga); }),
                  "was made for another batch");
  EXPECT_MENTIONS(error_of([&] { ga.gradient("no.such.weight"); }), "no such weight gradient");
}

TEST(Hardening, OutputThatCannotBeWrittenFailsLoudly) {
  const fs::path dir = scratch("output");
  const std::string file = (dir / "a_file").string();
  std::ofstream(file) << "x";
  EXPECT_MENTIONS(error_of([&] { OutputFile f(dir.string(), "test"); }), "it is a directory");
  EXPECT_MENTIONS(error_of([&] { OutputFile f((dir / "missing" / "x").string(), "test"); }), "does not exist");
  EXPECT_MENTIONS(error_of([&] { OutputFile f(file + "/x", "test"); }), "is not a directory");
  EXPECT_MENTIONS(error_of([&] { create_output_directory(file + "/sub", "test"); }), "cannot create the directory");
  EXPECT_MENTIONS(error_of([&] { Model::builtin(false).save(file + "/sub"); }), "cannot create the directory");
  if (fs::exists("/dev/full")) {  // a full disk shows when the buffer is flushed: at commit
    OutputFile full("/dev/full", "test");
    full.stream() << "some text";
    EXPECT_MENTIONS(error_of([&] { full.commit(); }), "No space left on device");
  }
  {  // not committed (an exception on the way): the partial file is removed
    OutputFile partial((dir / "partial").string(), "test");
    partial.stream() << "half";
  }
  EXPECT_FALSE(fs::exists(dir / "partial"));
  fs::remove_all(dir);
}

TEST(Hardening, CommandLineMessagesAreReadable) {
  auto parse = [](std::vector<const char*> args) {
    args.insert(args.begin(), "samebits");
    return tools::parse_command_line(int(args.size()), args.data());
  };
  auto p = parse({"frobnicate"});
  EXPECT_FALSE(p.request);
  EXPECT_EQ(p.exit_code, 2);
  EXPECT_MENTIONS(p.text, "unknown command 'frobnicate' (commands: verify, logprobs");
  p = parse({});
  EXPECT_MENTIONS(p.text, "a command is required");
  p = parse({"grads", "--micro-batch", "0", "--input", "x", "--output", "y"});
  EXPECT_MENTIONS(p.text, "--micro-batch: must be at least 1, got 0");
  EXPECT_EQ(p.text.find("1797693"), std::string::npos) << p.text;
  p = parse({"grads", "--micro-batch", "two", "--input", "x", "--output", "y"});
  EXPECT_MENTIONS(p.text, "must be a positive integer, got 'two'");
  p = parse({"export-model", "d", "--layers", "3"});
  EXPECT_MENTIONS(p.text, "--layers applies to --shape qwen3-8b only");
  p = parse({"export-model", "d", "--layers", "3", "--shape", "qwen3-8b"});
  ASSERT_TRUE(p.request);
  EXPECT_EQ(std::get<tools::ExportRequest>(*p.request).layers, 3);
  // grads and activations default to the built-in model, like logprobs.
  p = parse({"grads", "--input", "x", "--output", "y"});
  ASSERT_TRUE(p.request);
  EXPECT_TRUE(std::get<tools::GradsRequest>(*p.request).model.dir.empty());
  p = parse({"activations", "--input", "x", "--output", "y"});
  ASSERT_TRUE(p.request);
  p = parse({"logprobs", "--input", "x", "-q", "--progress"});
  EXPECT_FALSE(p.request);
  p = parse({"logprobs", "--help"});
  EXPECT_EQ(p.exit_code, 0);
  EXPECT_MENTIONS(p.text, "--input");
}

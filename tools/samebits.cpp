// The `samebits` command: verify (the status matrix and the chain gate), logprobs, export-model,
// version.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "samebits/chain.hpp"
#include "samebits/chain_gate.hpp"
#include "samebits/context.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "tools/logprobs_io.hpp"

using namespace samebits;

namespace {

// A command's --input: standard input for "-", else the file (opened into `file`).
std::istream& open_input(const char* command, const std::string& path, std::ifstream& file) {
  if (path == "-") return std::cin;
  file.open(path);
  if (!file) throw Error(command, "--input", "cannot open " + path);
  return file;
}

Backend pick_backend(const std::string& arg) { return choose_backend(arg.c_str(), "command line", "--backend"); }

struct VerifyArgs {
  std::string backend = "auto", status_dir, model_dir;
  uint64_t seed = 1234;
  std::vector<std::string> ops;
  bool json = false, quiet = false, no_chain = false;
};

int run_verify(const VerifyArgs& args) {
  const Backend backend = pick_backend(args.backend);
  auto wanted = [&](const std::string& op) {
    return args.ops.empty() || std::find(args.ops.begin(), args.ops.end(), op) != args.ops.end();
  };
  harness::CaseList cases;
  for (auto& c : harness::builtin_cases())
    if (wanted(c->op())) cases.push_back(c);
  const bool chain = !args.no_chain && wanted("chain");
  std::vector<std::pair<std::string, Model>> models;
  if (chain) {
    if (!args.model_dir.empty()) models.emplace_back(args.model_dir, Model::load(args.model_dir));
    else {
      models.emplace_back("builtin-untied", Model::builtin(false));
      models.emplace_back("builtin-tied", Model::builtin(true));
    }
  }
  if (cases.empty() && models.empty()) {
    std::cerr << "samebits verify: nothing matches the --op filter\n";
    return 2;
  }
  harness::SweepOptions opt;
  opt.seed = args.seed;
  opt.backend = backend;
  const size_t total = cases.size() + models.size();
  size_t done = 0;
  auto progress = [&](const std::string& name) {
    if (!args.quiet) std::cerr << fmt::format("[{:>2}/{}] {}\n", done, total, name);
  };
  if (!args.quiet) opt.progress = [&](const std::string& name) { ++done; progress(name); };
  const auto contract = harness::Contract::builtin();
  harness::Matrix m;
  m.backend = backend_name(backend);
  m.seed = args.seed;
  for (auto& c : cases) m.cases.push_back(harness::run_case(*c, contract, opt));
  for (auto& [label, model] : models) {
    ++done;
    harness::ChainGateOptions gate;
    gate.seed = args.seed;
    gate.backend = backend;
    m.cases.push_back(harness::run_chain_gate(model, label, contract, gate, progress));
  }
  std::cout << (args.json ? m.json() + "\n" : m.text());
  if (!args.status_dir.empty()) {
    std::filesystem::create_directories(args.status_dir);
    const std::string base = args.status_dir + "/" + m.backend;
    std::ofstream(base + ".md") << m.markdown();
    std::ofstream(base + ".json") << m.json() << "\n";
    if (!args.quiet) std::cerr << "wrote " << base << ".md and " << base << ".json\n";
  }
  const bool ok = m.all_pass();
  if (!args.json) {
    int not_built = 0, cells = 0;
    for (auto& c : m.cases)
      for (auto* cell : {&c.fwd_invariance, &c.fwd_accuracy, &c.bwd_invariance, &c.bwd_accuracy}) {
        cells += cell->status != harness::Status::not_applicable;
        not_built += cell->status == harness::Status::not_built;
      }
    if (!ok) std::cout << "\nverify: FAILED\n";
    else if (not_built == 0) std::cout << "\nverify: all cells PASS\n";
    else
      std::cout << fmt::format("\nverify: no failures, but {} of {} cells are NOT BUILT on the {} backend yet"
                               " (`--backend cpu` runs the CPU reference)\n", not_built, cells, m.backend);
  }
  return ok ? 0 : 1;
}

Model load_or_builtin(const std::string& dir, bool tied) { return dir.empty() ? Model::builtin(tied) : Model::load(dir); }

double peak_rss_mib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;  // Linux reports KiB
}

// Qwen3-8B's shape (36 layers in the real model; `layers` here), for export and load reports.
ModelConfig qwen3_8b_shape(int64_t layers) {
  ModelConfig c = Model::builtin(false).config();
  c.vocab_size = 151936;
  c.hidden_size = 4096;
  c.intermediate_size = 12288;
  c.num_layers = layers;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.rope.max_position = 40960;
  return c;
}

int inspect(const std::string& dir, bool tied) {
  const auto t0 = std::chrono::steady_clock::now();
  const Model m = load_or_builtin(dir, tied);
  const double load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const double rss_loaded = peak_rss_mib();
  std::vector<int32_t> tokens(16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t((i * 7919) % size_t(m.config().vocab_size));
  const auto t1 = std::chrono::steady_clock::now();
  const ChainForward f = Chain(m, Context{}).forward(ChainBatch::packed({tokens}));
  const double fwd_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
  int64_t params = 0, bytes = 0;
  for (auto& [name, w] : m.weights()) {
    params += w.numel();
    bytes += w.bytes();
  }
  const ModelConfig& c = m.config();
  std::cout << fmt::format(
      "model      {}\nshape      {} layers, hidden {}, intermediate {}, heads {}/{} x {}, vocab {}, {}, {}\n"
      "weights    {} tensors, {:.3f} G parameters, {:.1f} MiB\n"
      "load       {:.1f} ms ({}), peak RSS after load {:.1f} MiB\n"
      "forward    16 tokens on the CPU in {:.1f} ms, peak RSS after it {:.1f} MiB (logp[1] = {:.6f})\n",
      m.source(), c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
      c.vocab_size, dtype_name(c.dtype), c.tie_word_embeddings ? "tied" : "untied", m.weights().size(),
      double(params) * 1e-9, double(bytes) / 1048576.0, load_ms,
      dir.empty() ? "generated from its seed" : "memory-mapped", rss_loaded, fwd_ms, peak_rss_mib(), f.logp[1]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"samebits: batch-invariant transformer forward and backward, with proof"};
  app.require_subcommand(1);

  VerifyArgs va;
  auto* verify = app.add_subcommand("verify", "Run the ground-truth harness and the chain gate; print the status matrix");
  verify->add_option("--backend", va.backend, "cpu | cuda | auto (the GPU when present, else the CPU)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  verify->add_option("--seed", va.seed, "Seed of every generated input")->capture_default_str();
  verify->add_option("--op", va.ops, "Only these ops (repeatable), e.g. --op linear --op chain");
  verify->add_option("--model", va.model_dir, "Run the chain gate on this Hugging Face model directory");
  verify->add_flag("--no-chain", va.no_chain, "Skip the chain gate");
  verify->add_flag("--json", va.json, "Print the matrix with every drift report as JSON");
  verify->add_option("--status-dir", va.status_dir, "Also write <backend>.md and <backend>.json here");
  verify->add_flag("-q,--quiet", va.quiet, "No progress lines on stderr");

  std::string lp_model, lp_input, lp_output, lp_backend = "auto";
  bool lp_entropy = false, lp_tied = false;
  auto* logprobs = app.add_subcommand("logprobs", "Per-token logprobs of JSONL token sequences");
  logprobs->add_option("--model", lp_model, "Hugging Face model directory (default: the built-in model)");
  logprobs->add_flag("--builtin-tied", lp_tied, "Use the tied variant of the built-in model");
  logprobs->add_option("--input", lp_input, "JSONL: {\"tokens\": [...], \"loss_mask\": [...] (optional)} per line; - = stdin")
      ->required();
  logprobs->add_option("--output", lp_output, "Where to write the JSONL (default: stdout)");
  logprobs->add_flag("--entropy", lp_entropy, "Also write per-token entropies");
  logprobs->add_option("--backend", lp_backend, "cpu | cuda | auto")->check(CLI::IsMember({"auto", "cpu", "cuda"}));

  std::string gr_model, gr_input, gr_output, gr_backend = "auto";
  int gr_batch = 16;
  auto* grads_cmd = app.add_subcommand("grads", "Gradients of the summed logprobs of JSONL sequences, as fp32 safetensors");
  grads_cmd->add_option("--model", gr_model, "Hugging Face model directory")->required();
  grads_cmd->add_option("--input", gr_input, "JSONL as for logprobs; - = stdin")->required();
  grads_cmd->add_option("--output", gr_output, "The .safetensors file to write")->required();
  grads_cmd->add_option("--backend", gr_backend, "cpu | cuda | auto")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  grads_cmd->add_option("--micro-batch", gr_batch, "Sequences per micro-batch (the bits do not depend on it)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  std::string ac_model, ac_input, ac_output, ac_backend = "auto";
  auto* activations_cmd = app.add_subcommand(
      "activations", "Every activation of one forward of JSONL sequences (packed), as safetensors, for drift hunting");
  activations_cmd->add_option("--model", ac_model, "Hugging Face model directory")->required();
  activations_cmd->add_option("--input", ac_input, "JSONL as for logprobs; - = stdin")->required();
  activations_cmd->add_option("--output", ac_output, "The .safetensors file to write")->required();
  activations_cmd->add_option("--backend", ac_backend, "cpu | cuda | auto")->check(CLI::IsMember({"auto", "cpu", "cuda"}));

  std::string ex_dir, ex_shape = "builtin";
  bool ex_tied = false;
  uint64_t ex_seed = 1234;
  int64_t ex_layers = 1;
  auto* export_model = app.add_subcommand("export-model", "Write the built-in model (or a random model of a known shape) in the Hugging Face format");
  export_model->add_option("dir", ex_dir, "Output directory")->required();
  export_model->add_flag("--tied", ex_tied, "The tied-embedding variant");
  export_model->add_option("--seed", ex_seed, "Weight seed")->capture_default_str();
  export_model->add_option("--shape", ex_shape, "builtin | qwen3-8b (random weights)")
      ->check(CLI::IsMember({"builtin", "qwen3-8b"}))
      ->capture_default_str();
  export_model->add_option("--layers", ex_layers, "Layers, for --shape qwen3-8b")->capture_default_str();

  std::string in_model;
  bool in_tied = false;
  auto* inspect_cmd = app.add_subcommand("inspect", "Load a model; report its shape, load time and peak memory");
  inspect_cmd->add_option("--model", in_model, "Hugging Face model directory (default: the built-in model)");
  inspect_cmd->add_flag("--builtin-tied", in_tied, "Use the tied variant of the built-in model");

  app.add_subcommand("version", "Print the version and the backends built")->callback([] {
    std::cout << "samebits 0.1.0 (backends: cpu" << (cuda_backend_built() ? ", cuda" : "") << ")\n";
  });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (verify->parsed()) return run_verify(va);
    if (inspect_cmd->parsed()) return inspect(in_model, in_tied);
    if (export_model->parsed()) {
      if (ex_shape == "builtin") {
        Model::builtin(ex_tied, ex_seed).save(ex_dir);
      } else {
        ModelConfig c = qwen3_8b_shape(ex_layers);
        c.tie_word_embeddings = ex_tied;
        Model::random(c, ex_seed).save(ex_dir);
      }
      std::cerr << "wrote " << ex_dir << "/config.json and model.safetensors\n";
      return 0;
    }
    if (grads_cmd->parsed()) {
      const Model model = Model::load(gr_model);
      std::ifstream file;
      std::istream& in = open_input("grads", gr_input, file);
      const int64_t n = tools::write_gradients(model, pick_backend(gr_backend), in, gr_output, gr_batch);
      std::cerr << fmt::format("wrote the gradients of {} scored tokens to {}\n", n, gr_output);
      return 0;
    }
    if (activations_cmd->parsed()) {
      const Model model = Model::load(ac_model);
      std::ifstream file;
      std::istream& in = open_input("activations", ac_input, file);
      const int64_t n = tools::write_activations(model, pick_backend(ac_backend), in, ac_output);
      std::cerr << fmt::format("wrote the activations of {} rows to {}\n", n, ac_output);
      return 0;
    }
    if (logprobs->parsed()) {
      const Backend backend = pick_backend(lp_backend);
      const Model model = load_or_builtin(lp_model, lp_tied);
      std::ifstream file;
      std::istream& in = open_input("logprobs", lp_input, file);
      std::ofstream ofile;
      if (!lp_output.empty()) ofile.open(lp_output);
      std::ostream& out = lp_output.empty() ? std::cout : ofile;
      tools::write_logprobs(model, backend, in, out, lp_entropy);
      return 0;
    }
  } catch (const samebits::Error& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return 0;
}

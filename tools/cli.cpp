#include "tools/cli.hpp"

#include <algorithm>
#include <sstream>

#include <CLI/CLI.hpp>

namespace samebits::tools {

namespace {

// "--micro-batch 0" must say what is wrong in words, not CLI11's "Value 0 not in range 0.000000 to 1.79e308".
CLI::Validator positive_integer() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        size_t used = 0;
        long long v = 0;
        try {
          v = std::stoll(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size()) return "must be a positive integer, got '" + text + "'";
        if (v < 1) return "must be at least 1, got " + text;
        if (v > (1 << 30)) return "must be at most 2^30, got " + text;
        return {};
      },
      "INT >= 1");
}

const CLI::IsMember& backends() {
  static const CLI::IsMember b({"auto", "cpu", "cuda"});
  return b;
}

void add_model_choice(CLI::App* cmd, ModelChoice& m) {
  auto* dir = cmd->add_option("--model", m.dir, "Hugging Face model directory (default: the built-in model, vocab 2560)");
  cmd->add_flag("--builtin-tied", m.builtin_tied, "Use the tied variant of the built-in model")->excludes(dir);
}

void add_progress(CLI::App* cmd, bool& quiet, bool& forced) {
  auto* q = cmd->add_flag("-q,--quiet", quiet, "No progress on stderr");
  cmd->add_flag("--progress", forced, "Progress on stderr even when it is not a terminal")->excludes(q);
}

ProgressMode progress_mode(bool quiet, bool forced) {
  return quiet ? ProgressMode::off : forced ? ProgressMode::on : ProgressMode::automatic;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

ParsedCommandLine usage_error(const std::string& where, const std::string& message, const std::string& help_of) {
  ParsedCommandLine p;
  p.text = where + ": " + message + "\nRun '" + help_of + " --help' for the options.\n";
  p.text_is_error = true;
  p.exit_code = 2;
  return p;
}

}  // namespace

const std::vector<std::string>& command_names() {
  static const std::vector<std::string> names{"verify", "logprobs", "grads", "activations", "generate", "export-model",
                                              "inspect", "version"};
  return names;
}

ParsedCommandLine parse_command_line(int argc, const char* const* argv) {
  // The command is the first argument that is not an option; name it when it is unknown (CLI11
  // would say only "A subcommand is required").
  const auto& names = command_names();
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i] ? argv[i] : "";
    if (a == "-h" || a == "--help") help = true;
    if (a.empty() || a[0] == '-') continue;
    if (std::find(names.begin(), names.end(), a) == names.end())
      return usage_error("samebits", "unknown command '" + a.substr(0, 64) + "' (commands: " + joined(names) + ")",
                         "samebits");
    break;
  }

  CLI::App app{"samebits: batch-invariant transformer forward and backward, with proof"};
  app.require_subcommand(1);
  app.footer("Exit codes: 0 done; 1 verify found a failing cell; 2 bad input, bad arguments or an I/O error (the\n"
             "message names it); 3 out of memory; 70 an internal error (please report it).");
  ParsedCommandLine out;

  VerifyRequest verify;
  auto* verify_cmd = app.add_subcommand("verify", "Run the ground-truth harness and the chain gate; print the status matrix");
  verify_cmd->add_option("--backend", verify.backend, "cpu | cuda | auto (the GPU when present, else the CPU)")
      ->check(backends())
      ->capture_default_str();
  verify_cmd->add_option("--seed", verify.seed, "Seed of every generated input")->capture_default_str();
  verify_cmd->add_option("--op", verify.ops, "Only these ops (repeatable), e.g. --op linear --op chain");
  verify_cmd->add_option("--model", verify.model_dir, "Run the chain gate on this Hugging Face model directory");
  verify_cmd->add_flag("--no-chain", verify.no_chain, "Skip the chain gate");
  verify_cmd->add_flag("--json", verify.json, "Print the matrix with every drift report as JSON");
  verify_cmd->add_option("--status-dir", verify.status_dir, "Also write <backend>.md and <backend>.json here");
  verify_cmd->add_flag("-q,--quiet", verify.quiet, "No progress lines on stderr");

  LogprobsRequest logprobs;
  bool lp_quiet = false, lp_progress = false;
  auto* logprobs_cmd = app.add_subcommand("logprobs", "Per-token logprobs of JSONL token sequences");
  add_model_choice(logprobs_cmd, logprobs.model);
  logprobs_cmd->add_option("--input", logprobs.input, "JSONL: {\"tokens\": [...], \"loss_mask\": [...] (optional)} per line; - = stdin")
      ->required();
  logprobs_cmd->add_option("--output", logprobs.output, "Where to write the JSONL (default: stdout)");
  logprobs_cmd->add_flag("--entropy", logprobs.entropy, "Also write per-token entropies");
  logprobs_cmd->add_option("--backend", logprobs.backend, "cpu | cuda | auto")->check(backends());
  add_progress(logprobs_cmd, lp_quiet, lp_progress);

  GradsRequest grads;
  bool gr_quiet = false, gr_progress = false;
  auto* grads_cmd = app.add_subcommand("grads", "Gradients of the summed logprobs of JSONL sequences, as fp32 safetensors");
  add_model_choice(grads_cmd, grads.model);
  grads_cmd->add_option("--input", grads.input, "JSONL as for logprobs; - = stdin")->required();
  grads_cmd->add_option("--output", grads.output, "The .safetensors file to write")->required();
  grads_cmd->add_option("--backend", grads.backend, "cpu | cuda | auto")->check(backends());
  grads_cmd->add_option("--micro-batch", grads.micro_batch,
                        "Sequences per micro-batch (the bits depend on the sequences' order, never on this)")
      ->check(positive_integer())
      ->capture_default_str();
  grads_cmd->add_flag("--recompute", grads.recompute,
                      "Keep only each layer's input and rerun the layer in the backward: less memory, the same bits");
  grads_cmd->add_option("--lm-head-keep-mb", grads.lm_head_keep_mb,
                        "MiB the LM head may keep logits in for the backward (GPU: three vocab GEMMs instead of "
                        "four for the sequences that fit; the same bits)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  add_progress(grads_cmd, gr_quiet, gr_progress);

  ActivationsRequest activations;
  auto* activations_cmd = app.add_subcommand(
      "activations", "Every activation of one forward of JSONL sequences (packed), as safetensors, for drift hunting");
  add_model_choice(activations_cmd, activations.model);
  activations_cmd->add_option("--input", activations.input, "JSONL as for logprobs; - = stdin")->required();
  activations_cmd->add_option("--output", activations.output, "The .safetensors file to write")->required();
  activations_cmd->add_option("--backend", activations.backend, "cpu | cuda | auto")->check(backends());

  GenerateRequest gen;
  bool gen_quiet = false, gen_progress = false;
  auto* generate_cmd = app.add_subcommand(
      "generate", "Sample completions of JSONL prompts; each token's logprob is the trainer's, bit for bit");
  add_model_choice(generate_cmd, gen.model);
  generate_cmd->add_option("--input", gen.input,
                           "JSONL: {\"tokens\": [...], and optionally \"n\", \"temperature\", \"top_k\", \"top_p\", "
                           "\"min_p\", \"max_new_tokens\", \"stop\", \"seed\"} per line; - = stdin")
      ->required();
  generate_cmd->add_option("--output", gen.output, "Where to write the JSONL (default: stdout)");
  generate_cmd->add_option("--backend", gen.backend, "cpu | cuda | auto")->check(backends());
  generate_cmd->add_option("-n,--n", gen.sampling.n, "Samples per prompt (they share its prefill)")->check(positive_integer())->capture_default_str();
  generate_cmd->add_option("--temperature", gen.sampling.temperature, "0: greedy")->capture_default_str();
  generate_cmd->add_option("--top-k", gen.sampling.top_k, "0: off")->capture_default_str();
  generate_cmd->add_option("--top-p", gen.sampling.top_p, "in (0, 1]; 1: off")->capture_default_str();
  generate_cmd->add_option("--min-p", gen.sampling.min_p, "in [0, 1); 0: off")->capture_default_str();
  generate_cmd->add_option("--max-new-tokens", gen.sampling.max_new_tokens, "Tokens to generate at most")
      ->check(positive_integer())
      ->capture_default_str();
  generate_cmd->add_option("--stop", gen.sampling.stop_token_ids, "Stop token ids (repeatable); a sampled one ends its sample");
  generate_cmd->add_option("--seed", gen.sampling.seed, "Seed of the sampling (a line's own \"seed\" wins)")->capture_default_str();
  generate_cmd->add_option("--max-slots", gen.max_slots, "Samples decoding at once")->check(positive_integer())->capture_default_str();
  generate_cmd->add_option("--max-batch-tokens", gen.max_batch_tokens, "Rows a step runs (decode rows + prefill chunks)")
      ->check(positive_integer())
      ->capture_default_str();
  generate_cmd->add_option("--max-context", gen.max_context, "Tokens a slot holds (0: min(max_position_embeddings, 4096))")
      ->capture_default_str();
  generate_cmd->add_option("--page-size", gen.page_size, "KV-cache page, in tokens")->check(positive_integer())->capture_default_str();
  generate_cmd->add_option("--kv-pages", gen.kv_pages, "Pages in the KV pool (0: every slot's max_context)")
      ->capture_default_str();
  generate_cmd->add_option("--kv-memory-mib", gen.kv_memory_mib, "Or: the KV pool's size in MiB")->capture_default_str();
  generate_cmd->add_flag("--no-cuda-graphs", gen.no_cuda_graphs,
                         "Run every decode step eagerly (by default a Hopper GPU replays one CUDA graph a step; same bits)");
  generate_cmd->add_flag("--no-overlap", gen.no_overlap,
                         "Wait for every step's draws before the next step is prepared (by default step N + 1 is "
                         "launched while step N runs; same bits)");
  generate_cmd->add_flag("--sampling-logprobs", gen.sampling_logprobs,
                         "Also write \"sampling_logprobs\": each token's logprob under the distribution it was drawn from "
                         "(temperature, top-k / top-p / min-p applied; 0 for greedy)");
  add_progress(generate_cmd, gen_quiet, gen_progress);

  ExportRequest exported;
  int64_t layers = 1;
  auto* export_cmd = app.add_subcommand("export-model", "Write the built-in model (or a random model of a known shape) in the Hugging Face format");
  export_cmd->add_option("dir", exported.dir, "Output directory")->required();
  export_cmd->add_flag("--tied", exported.tied, "The tied-embedding variant");
  export_cmd->add_option("--seed", exported.seed, "Weight seed")->capture_default_str();
  export_cmd->add_option("--shape", exported.shape, "builtin | qwen3-8b (random weights)")
      ->check(CLI::IsMember({"builtin", "qwen3-8b"}))
      ->capture_default_str();
  auto* layers_opt = export_cmd->add_option("--layers", layers, "Layers, for --shape qwen3-8b (default 1)")
                         ->check(positive_integer());

  InspectRequest inspect;
  auto* inspect_cmd = app.add_subcommand("inspect", "Load a model; report its shape, load time and peak memory");
  add_model_choice(inspect_cmd, inspect.model);

  auto* version_cmd = app.add_subcommand("version", "Print the version, the backends built and the OpenMP settings");

  std::vector<std::string> args;
  for (int i = argc - 1; i >= 1; --i) args.push_back(argv[i] ? argv[i] : "");  // CLI11 takes them reversed
  CLI::App* failed_in = &app;
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    for (CLI::App* sub : app.get_subcommands())
      if (sub->parsed()) failed_in = sub;
    if (e.get_exit_code() == 0 || help) {  // --help
      std::ostringstream o, err;
      app.exit(e, o, err);
      out.text = o.str() + err.str();
      out.exit_code = e.get_exit_code();
      return out;
    }
    const std::string where = failed_in == &app ? "samebits" : "samebits " + failed_in->get_name();
    std::string what = e.what();
    if (what == "A subcommand is required")
      what = "a command is required (commands: " + joined(command_names()) + ")";
    return usage_error(where, what, where);
  }

  if (verify_cmd->parsed()) out.request = verify;
  else if (logprobs_cmd->parsed()) {
    logprobs.progress = progress_mode(lp_quiet, lp_progress);
    out.request = logprobs;
  } else if (grads_cmd->parsed()) {
    grads.progress = progress_mode(gr_quiet, gr_progress);
    out.request = grads;
  } else if (activations_cmd->parsed()) out.request = activations;
  else if (generate_cmd->parsed()) {
    gen.progress = progress_mode(gen_quiet, gen_progress);
    out.request = gen;
  }
  else if (export_cmd->parsed()) {
    if (layers_opt->count() > 0) {
      if (exported.shape != "qwen3-8b")
        return usage_error("samebits export-model",
                           "--layers applies to --shape qwen3-8b only (the built-in model's shape is fixed: 2 layers)",
                           "samebits export-model");
      exported.layers = layers;
    }
    out.request = exported;
  } else if (inspect_cmd->parsed()) out.request = inspect;
  else if (version_cmd->parsed()) out.request = VersionRequest{};
  return out;
}

}  // namespace samebits::tools

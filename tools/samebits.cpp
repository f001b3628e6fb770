// The `samebits` command: verify (the status matrix and the chain gate), logprobs, grads,
// activations, export-model, inspect, version. The command line is parsed first (tools/cli.cpp);
// each subcommand is one run function below (verify's in tools/verify.cpp, the one part of the
// command that includes the harness); one handler turns every failure into a message
// and an exit code (never a signal, never exit 0 with the output lost).
#include <unistd.h>

#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <new>
#include <variant>

#include <fmt/format.h>

#include "samebits/chain.hpp"
#include "samebits/context.hpp"
#include "samebits/error.hpp"
#include "src/core/output_file.hpp"
#include "tools/cli.hpp"
#include "tools/generate_io.hpp"
#include "tools/logprobs_io.hpp"
#include "tools/verify.hpp"

using namespace samebits;
using namespace samebits::tools;
namespace fs = std::filesystem;

namespace {

// What the command is doing now, for an "out of memory while …" message.
std::string doing = "starting";

// OpenMP reads OMP_WAIT_POLICY once, when its runtime loads (before main). Its default lets idle
// threads spin, which on a shared machine takes the cores other processes need (`verify --op
// chain`: 5.2 s alone, 14.7 s beside one busy process). Unless the user chose a policy, the
// command restarts itself once with the passive one.
void use_passive_openmp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY")) return;
  ::setenv("OMP_WAIT_POLICY", "passive", 1);
  ::execv("/proc/self/exe", argv);  // returns only if it failed: carry on with the default policy
}

// A command's --input: standard input for "-", else the file (opened into `file`).
std::istream& open_input(const std::string& command, const std::string& path, std::ifstream& file) {
  if (path == "-") return std::cin;
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw Error(command, "--input", path + " is a directory, not a JSONL file");
  errno = 0;
  file.open(path);
  if (!file) throw Error(command, "--input", "cannot open " + path + (errno ? std::string(": ") + std::strerror(errno) : ""));
  return file;
}

Backend pick_backend(const std::string& arg) { return choose_backend(arg.c_str(), "command line", "--backend"); }

Model load_model(const ModelChoice& m) {
  doing = m.dir.empty() ? "building the built-in model" : "loading the model in " + m.dir;
  return m.dir.empty() ? Model::builtin(m.builtin_tied) : Model::load(m.dir);
}

std::vector<InputSequence> read_input(const std::string& command, const std::string& path, const Model& model) {
  doing = "reading " + (path == "-" ? std::string("standard input") : path);
  std::ifstream file;
  std::istream& in = open_input(command, path, file);
  return read_sequences(in, model.config(), command);
}

std::string duration(double seconds) {
  const auto s = int64_t(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}h{:02}m", s / 3600, s / 60 % 60)
                   : s >= 60 ? fmt::format("{}m{:02}s", s / 60, s % 60) : fmt::format("{}s", s);
}

// Progress of a long logprobs / grads run on stderr: sequences and tokens done, tokens/s, ETA. On a
// terminal one line rewritten in place (unless -q); elsewhere nothing unless --progress asks, then a
// line every few seconds.
ProgressFn progress_printer(const std::string& command, ProgressMode mode) {
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  if (mode == ProgressMode::off || (mode == ProgressMode::automatic && !tty)) return {};
  using clock = std::chrono::steady_clock;
  struct State {
    clock::time_point start = clock::now(), last{};
  };
  auto st = std::make_shared<State>();
  return [command, tty, st](const Progress& p) {
    const auto now = clock::now();
    const bool done = p.sequences_done == p.sequences;
    if (!done && p.sequences_done > 0 && now - st->last < std::chrono::milliseconds(tty ? 500 : 5000)) return;
    st->last = now;
    const double elapsed = std::chrono::duration<double>(now - st->start).count();
    const double rate = elapsed > 0 ? double(p.tokens_done) / elapsed : 0.0;
    std::string line = fmt::format("{}: {}/{} sequences, {}/{} tokens", command, p.sequences_done, p.sequences,
                                   p.tokens_done, p.tokens);
    if (p.tokens_done > 0) line += fmt::format(", {:.0f} tokens/s", rate);
    if (done) line += fmt::format(", done in {}", duration(elapsed));
    else if (rate > 0) line += fmt::format(", ETA {}", duration(double(p.tokens - p.tokens_done) / rate));
    std::cerr << (tty ? "\r\033[K" : "") << line << (tty && !done ? "" : "\n") << std::flush;
  };
}

int run(const VersionRequest&) {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  std::cout << "samebits 0.1.0 (backends: cpu" << (cuda_backend_built() ? ", cuda" : "") << ")\n"
            << "OpenMP: " << omp_get_max_threads() << " threads, OMP_WAIT_POLICY=" << (policy ? policy : "(unset)")
            << "\n";
  check_stream(std::cout, "version", "standard output");
  return 0;
}

int run(const VerifyRequest& r) { return run_verify(r, doing); }

int run(const LogprobsRequest& r) {
  const Backend backend = pick_backend(r.backend);
  const Model model = load_model(r.model);
  const std::vector<InputSequence> seqs = read_input("logprobs", r.input, model);
  std::unique_ptr<OutputFile> file;
  if (!r.output.empty()) file = std::make_unique<OutputFile>(r.output, "logprobs");
  doing = "scoring the sequences";
  write_logprobs(model, backend, seqs, file ? file->stream() : std::cout, r.entropy, 16,
                 progress_printer("logprobs", r.progress));
  if (file) file->commit();
  else check_stream(std::cout, "logprobs", "standard output");
  return 0;
}

// grads and activations: the backend, the output checked before any work, the model, the input.
struct SafetensorsJob {
  Backend backend;
  Model model;
  std::vector<InputSequence> seqs;
};

SafetensorsJob prepare(const std::string& command, const std::string& backend, const std::string& output,
                       const ModelChoice& model, const std::string& input) {
  SafetensorsJob job{pick_backend(backend), Model{}, {}};
  check_writable(output, command);
  job.model = load_model(model);
  job.seqs = read_input(command, input, job.model);
  return job;
}

int run(const GradsRequest& r) {
  const SafetensorsJob job = prepare("grads", r.backend, r.output, r.model, r.input);
  doing = "computing the gradients";
  const int64_t n = write_gradients(job.model, job.backend, job.seqs, r.output, r.micro_batch,
                                    progress_printer("grads", r.progress),
                                    r.recompute ? ForwardKeep::layer_inputs : ForwardKeep::all,
                                    int64_t(r.lm_head_keep_mb) << 20);
  std::cerr << fmt::format("wrote the gradients of {} scored tokens to {}\n", n, r.output);
  return 0;
}

int run(const ActivationsRequest& r) {
  const SafetensorsJob job = prepare("activations", r.backend, r.output, r.model, r.input);
  doing = "running the forward";
  const int64_t n = write_activations(job.model, job.backend, job.seqs, r.output);
  std::cerr << fmt::format("wrote the activations of {} rows to {}\n", n, r.output);
  return 0;
}

int run(const GenerateRequest& r) {
  EngineOptions opt;
  opt.backend = pick_backend(r.backend);
  opt.max_slots = r.max_slots;
  opt.max_batch_tokens = r.max_batch_tokens;
  opt.max_context = r.max_context;
  opt.page_size = r.page_size;
  opt.kv_pages = r.kv_pages;
  opt.kv_memory_bytes = r.kv_memory_mib << 20;
  opt.cuda_graphs = !r.no_cuda_graphs;
  opt.overlap_steps = !r.no_overlap;
  const Model model = load_model(r.model);
  doing = "reading " + (r.input == "-" ? std::string("standard input") : r.input);
  std::ifstream file;
  const std::vector<PromptLine> prompts = read_prompts(open_input("generate", r.input, file), r.sampling);
  std::unique_ptr<OutputFile> out;
  if (!r.output.empty()) out = std::make_unique<OutputFile>(r.output, "generate");
  doing = "generating";
  // Progress: tokens generated and tokens/s after each engine step (an open-ended run: no ETA).
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  const bool show = r.progress == ProgressMode::on || (r.progress == ProgressMode::automatic && tty);
  const auto start = std::chrono::steady_clock::now();
  auto last = start - std::chrono::hours(1);
  int64_t generated = 0, steps_run = 0;
  auto rate_line = [&] {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return fmt::format("generate: {} tokens in {} steps, {:.0f} tokens/s", generated, steps_run,
                       s > 0 ? double(generated) / s : 0.0);
  };
  std::function<void(int64_t, int64_t)> progress;
  if (show)
    progress = [&](int64_t tokens, int64_t steps) {
      generated = tokens;
      steps_run = steps;
      const auto now = std::chrono::steady_clock::now();
      if (now - last < std::chrono::milliseconds(tty ? 500 : 5000)) return;
      last = now;
      std::cerr << (tty ? "\r\033[K" : "") << rate_line() << (tty ? "" : "\n") << std::flush;
    };
  const int64_t failed =
      write_generations(model, opt, prompts, out ? out->stream() : std::cout, progress, r.sampling_logprobs);
  if (out) out->commit();
  else check_stream(std::cout, "generate", "standard output");
  if (show) std::cerr << (tty ? "\r\033[K" : "") << rate_line() << ", done\n";
  if (failed > 0) std::cerr << fmt::format("samebits generate: {} of {} prompts failed (their lines say why)\n", failed,
                                           prompts.size());
  return failed > 0 ? 2 : 0;
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

int64_t weight_bytes(const ModelConfig& c) {
  int64_t bytes = 0;
  for (auto& [name, shape] : c.expected_tensors()) {
    int64_t n = dtype_size(c.dtype);
    for (int64_t d : shape) n *= d;
    bytes += n;
  }
  return bytes;
}

int run(const ExportRequest& r) {
  create_output_directory(r.dir, "export-model");
  if (r.shape == "builtin") {
    doing = "building the built-in model";
    const Model m = Model::builtin(r.tied, r.seed);
    doing = "writing " + r.dir;
    m.save(r.dir);
  } else {
    ModelConfig c = qwen3_8b_shape(r.layers.value_or(1));
    c.tie_word_embeddings = r.tied;
    doing = fmt::format("generating a qwen3-8b-shaped model ({} layer(s), {:.2f} GB of weights)", c.num_layers,
                        double(weight_bytes(c)) * 1e-9);
    const Model m = Model::random(c, r.seed);
    doing = "writing " + r.dir;
    m.save(r.dir);
  }
  std::cerr << "wrote " << r.dir << "/config.json and model.safetensors\n";
  return 0;
}

double peak_rss_mib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;  // Linux reports KiB
}

// 488000 -> "488000 (488.0 K)"; 8190735360 -> "8190735360 (8.19 G)".
std::string count_with_unit(int64_t n) {
  const double x = double(n);
  if (x >= 1e9) return fmt::format("{} ({:.2f} G)", n, x * 1e-9);
  if (x >= 1e6) return fmt::format("{} ({:.2f} M)", n, x * 1e-6);
  if (x >= 1e3) return fmt::format("{} ({:.1f} K)", n, x * 1e-3);
  return fmt::format("{}", n);
}

int run(const InspectRequest& r) {
  const auto t0 = std::chrono::steady_clock::now();
  const Model m = load_model(r.model);
  const double load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const double rss_loaded = peak_rss_mib();
  std::vector<int32_t> tokens(16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t((i * 7919) % size_t(m.config().vocab_size));
  doing = "running a 16-token forward";
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
      "weights    {} tensors, {} parameters, {:.1f} MiB\n"
      "load       {:.1f} ms ({}), peak RSS after load {:.1f} MiB\n"
      "forward    16 tokens on the CPU in {:.1f} ms, peak RSS after it {:.1f} MiB (logp[1] = {:.6f})\n",
      m.source(), c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
      c.vocab_size, dtype_name(c.dtype), c.tie_word_embeddings ? "tied" : "untied", m.weights().size(),
      count_with_unit(params), double(bytes) / 1048576.0, load_ms,
      r.model.dir.empty() ? "generated from its seed" : "memory-mapped", rss_loaded, fwd_ms, peak_rss_mib(), f.logp[1]);
  check_stream(std::cout, "inspect", "standard output");
  return 0;
}

// The one handler: every failure becomes a message on stderr naming the command and a non-zero
// exit code (see the --help footer).
int run_guarded(const Request& request) {
  static const char* const names[] = {"version", "verify",       "logprobs", "grads",
                                      "activations", "export-model", "inspect",  "generate"};
  const std::string command = names[request.index()];
  try {
    return std::visit([](const auto& r) { return run(r); }, request);
  } catch (const Error& e) {
    std::cerr << e.what() << "\n";
    return 2;
  } catch (const std::bad_alloc&) {
    std::cerr << "samebits " << command << ": out of memory while " << doing << "\n";
    return 3;
  } catch (const fs::filesystem_error& e) {
    std::cerr << "samebits " << command << ": file system error while " << doing << ": " << e.what() << "\n";
    return 2;
  } catch (const std::ios_base::failure& e) {
    std::cerr << "samebits " << command << ": I/O error while " << doing << ": " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "samebits " << command << ": internal error while " << doing << ": " << e.what()
              << " (please report it)\n";
    return 70;
  } catch (...) {
    std::cerr << "samebits " << command << ": internal error while " << doing << " (please report it)\n";
    return 70;
  }
}

}  // namespace

int main(int argc, char** argv) {
  use_passive_openmp(argv);
  const ParsedCommandLine parsed = parse_command_line(argc, argv);
  if (!parsed.request) {
    (parsed.text_is_error ? std::cerr : std::cout) << parsed.text;
    return parsed.exit_code;
  }
  return run_guarded(*parsed.request);
}

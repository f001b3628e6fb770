// The `samebits` command: verify (the status matrix), version.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "samebits/context.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"

using namespace samebits;

namespace {

int run_verify(const std::string& backend_arg, uint64_t seed, const std::vector<std::string>& ops,
               bool json, const std::string& status_dir, bool quiet) {
  Backend backend = Backend::cpu;
  if (backend_arg == "auto") {
    backend = cuda_device_present() ? Backend::cuda : Backend::cpu;
  } else {
    backend = backend_from_name(backend_arg.c_str());
    if (backend == Backend::cuda && !cuda_backend_built()) {
      std::cerr << "samebits verify: this build has no CUDA backend (nvcc was not found at build time)\n";
      return 2;
    }
    if (backend == Backend::cuda && !cuda_device_present()) {
      std::cerr << "samebits verify: --backend cuda, but no CUDA device is visible\n";
      return 2;
    }
  }
  harness::CaseList cases;
  for (auto& c : harness::builtin_cases())
    if (ops.empty() || std::find(ops.begin(), ops.end(), c->op()) != ops.end()) cases.push_back(c);
  if (cases.empty()) {
    std::cerr << "samebits verify: no case matches the --op filter\n";
    return 2;
  }
  harness::SweepOptions opt;
  opt.seed = seed;
  opt.backend = backend;
  size_t done = 0;
  if (!quiet)
    opt.progress = [&](const std::string& name) {
      std::cerr << fmt::format("[{:>2}/{}] {}\n", ++done, cases.size(), name);
    };
  const auto contract = harness::Contract::builtin();
  harness::Matrix m;
  m.backend = backend_name(backend);
  m.seed = seed;
  for (auto& c : cases) m.cases.push_back(harness::run_case(*c, contract, opt));
  std::cout << (json ? m.json() + "\n" : m.text());
  if (!status_dir.empty()) {
    std::filesystem::create_directories(status_dir);
    const std::string base = status_dir + "/" + m.backend;
    std::ofstream(base + ".md") << m.markdown();
    std::ofstream(base + ".json") << m.json() << "\n";
    if (!quiet) std::cerr << "wrote " << base << ".md and " << base << ".json\n";
  }
  const bool ok = m.all_pass();
  if (!json) {
    int not_built = 0, total = 0;
    for (auto& c : m.cases)
      for (auto* cell : {&c.fwd_invariance, &c.fwd_accuracy, &c.bwd_invariance, &c.bwd_accuracy}) {
        total += cell->status != harness::Status::not_applicable;
        not_built += cell->status == harness::Status::not_built;
      }
    if (!ok) std::cout << "\nverify: FAILED\n";
    else if (not_built == 0) std::cout << "\nverify: all cells PASS\n";
    else
      std::cout << fmt::format("\nverify: no failures, but {} of {} cells are NOT BUILT on the {} backend yet"
                               " (`--backend cpu` runs the CPU reference)\n", not_built, total, m.backend);
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"samebits: batch-invariant transformer forward and backward, with proof"};
  app.require_subcommand(1);

  auto* verify = app.add_subcommand("verify", "Run the ground-truth harness and print the status matrix");
  std::string backend = "auto", status_dir;
  uint64_t seed = 1234;
  std::vector<std::string> ops;
  bool json = false, quiet = false;
  verify->add_option("--backend", backend, "cpu | cuda | auto (the GPU when present, else the CPU)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  verify->add_option("--seed", seed, "Seed of every generated input")->capture_default_str();
  verify->add_option("--op", ops, "Only these ops (repeatable), e.g. --op linear --op attention");
  verify->add_flag("--json", json, "Print the matrix with every drift report as JSON");
  verify->add_option("--status-dir", status_dir, "Also write <backend>.md and <backend>.json here");
  verify->add_flag("-q,--quiet", quiet, "No progress lines on stderr");

  app.add_subcommand("version", "Print the version and the backends built")->callback([] {
    std::cout << "samebits 0.1.0 (backends: cpu" << (cuda_backend_built() ? ", cuda" : "") << ")\n";
  });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (verify->parsed()) {
    try {
      return run_verify(backend, seed, ops, json, status_dir, quiet);
    } catch (const samebits::Error& e) {
      std::cerr << e.what() << "\n";
      return 2;
    }
  }
  return 0;
}

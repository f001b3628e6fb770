// `samebits verify`: the op cases of the harness and the chain gate on a backend; prints the
// status matrix and, with --status-dir, writes it as markdown and JSON.
#include "tools/verify.hpp"

#include <algorithm>
#include <filesystem>
#include <iostream>

#include <fmt/format.h>

#include "samebits/chain_gate.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "src/core/output_file.hpp"

namespace samebits::tools {

namespace fs = std::filesystem;

int run_verify(const VerifyRequest& args, std::string& doing) {
  const Backend backend = choose_backend(args.backend.c_str(), "command line", "--backend");
  if (!args.status_dir.empty()) create_output_directory(args.status_dir, "verify");  // fail before the run
  auto wanted = [&](const std::string& op) {
    return args.ops.empty() || std::find(args.ops.begin(), args.ops.end(), op) != args.ops.end();
  };
  harness::CaseList cases;
  for (auto& c : harness::builtin_cases())
    if (wanted(c->op())) cases.push_back(c);
  const bool chain = !args.no_chain && wanted("chain");
  std::vector<std::pair<std::string, Model>> models;
  if (chain) {
    doing = "loading the models of the chain gate";
    if (!args.model_dir.empty()) models.emplace_back(args.model_dir, Model::load(args.model_dir));
    else {
      models.emplace_back("builtin-untied", Model::builtin(false));
      models.emplace_back("builtin-tied", Model::builtin(true));
    }
  }
  if (cases.empty() && models.empty()) throw Error("verify", "--op", "nothing matches the --op filter");
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
  doing = "running the op cases";
  for (auto& c : cases) m.cases.push_back(harness::run_case(*c, contract, opt));
  doing = "running the chain gate";
  for (auto& [label, model] : models) {
    ++done;
    harness::ChainGateOptions gate;
    gate.seed = args.seed;
    gate.backend = backend;
    m.cases.push_back(harness::run_chain_gate(model, label, contract, gate, progress));
  }
  std::cout << (args.json ? m.json() + "\n" : m.text());
  if (!args.status_dir.empty()) {
    const std::string base = (fs::path(args.status_dir) / m.backend).string();
    for (auto [ext, text] : {std::pair<const char*, std::string>{".md", m.markdown()}, {".json", m.json() + "\n"}}) {
      OutputFile file(base + ext, "verify");
      file.stream() << text;
      file.commit();
    }
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
  check_stream(std::cout, "verify", "standard output");
  return ok ? 0 : 1;
}

}  // namespace samebits::tools

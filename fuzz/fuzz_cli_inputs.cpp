// libFuzzer target for what the `samebits` command reads from its user: the JSONL token sequences
// (tools::read_sequences: JSON of any shape and depth, ids, masks, lengths) and the command line
// (tools::parse_command_line: argv -> request, no work done). The reader may reject its input with
// samebits::Error and the parser with a usage message; anything else (a crash, an ASan report,
// another exception type, a hang) is a bug.
// An input whose first line is "#!argv" is a command line, one argument per following line;
// every other input is JSONL read against the built-in model's config.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "samebits/error.hpp"
#include "samebits/model.hpp"
#include "tools/cli.hpp"
#include "tools/logprobs_io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const samebits::ModelConfig config = [] {
    samebits::ModelConfig c = samebits::Model::builtin(false).config();
    c.rope.max_position = 4096;  // long enough to reach, short enough to pass, within -max_len
    return c;
  }();
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::string marker = "#!argv\n";
  if (text.compare(0, marker.size(), marker) == 0) {
    std::vector<std::string> args{"samebits"};
    std::istringstream lines(text.substr(marker.size()));
    for (std::string a; std::getline(lines, a);) args.push_back(a);
    std::vector<const char*> argv;
    for (auto& a : args) argv.push_back(a.c_str());
    const auto parsed = samebits::tools::parse_command_line(int(argv.size()), argv.data());
    if (!parsed.request && parsed.text.empty()) __builtin_trap();  // neither a request nor a message
    return 0;
  }
  try {
    std::istringstream in(text);
    for (const auto& s : samebits::tools::read_sequences(in, config, "fuzz")) {
      if (s.tokens.empty() || int64_t(s.tokens.size()) > config.rope.max_position) __builtin_trap();
      for (int32_t t : s.tokens)
        if (t < 0 || t >= config.vocab_size) __builtin_trap();
      if (!s.mask.empty() && s.mask.size() != s.tokens.size()) __builtin_trap();
    }
  } catch (const samebits::Error&) {
  }
  return 0;
}

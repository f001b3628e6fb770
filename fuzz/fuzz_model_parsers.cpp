// libFuzzer target for the parsers that read untrusted model files: the safetensors header and
// config.json. Either parser may reject its input with samebits::Error; anything else (a crash, an
// out-of-bounds read under ASan, another exception type, a hang) is a bug.
// Inputs starting with '{' are fed to the config parser, everything else to the safetensors parser.
#include <cstddef>
#include <cstdint>
#include <string>

#include "samebits/error.hpp"
#include "samebits/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    if (size > 0 && data[0] == '{') {
      const auto config = samebits::ModelConfig::from_json(std::string(reinterpret_cast<const char*>(data), size));
      (void)config.expected_tensors();
    } else {
      uint64_t data_start = 0;
      const auto entries = samebits::parse_safetensors_header(data, size, "fuzz input", &data_start);
      for (const auto& e : entries)  // every accepted entry must lie inside the input
        if (data_start + e.end > size) __builtin_trap();
    }
  } catch (const samebits::Error&) {
  }
  return 0;
}

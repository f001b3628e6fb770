// JSON read from outside (config.json, safetensors headers, JSONL inputs) and quoted in errors.
// Hostile text may nest tens of thousands deep: parsing it is iterative in nlohmann, but dumping
// or destroying such a value recurses, and an error that quotes a value whole can be megabytes.
// So every outside text goes through parse_json (nesting bounded before the parser sees it) and
// every error quotes a value through quote_json (bounded length).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace samebits {

// Deeper than any real config or input (Hugging Face configs nest 3 deep).
inline constexpr int kMaxJsonDepth = 64;

// Parses `text`; throws samebits::Error(op, where, "is not valid JSON: …" or "nests deeper than …").
nlohmann::json parse_json(const char* begin, const char* end, const std::string& op, const std::string& where);
inline nlohmann::json parse_json(const std::string& text, const std::string& op, const std::string& where) {
  return parse_json(text.data(), text.data() + text.size(), op, where);
}

// A value as it may appear in an error message: its JSON text cut to `max_chars` (then "…" and its
// full size), e.g. `"abc"`, `64.9`, `[1, 2, 3, …] (an array of 4000 values)`.
std::string quote_json(const nlohmann::json& value, size_t max_chars = 48);

}  // namespace samebits

#include "core/json_text.hpp"

#include <fmt/format.h>

#include "samebits/error.hpp"

namespace samebits {

namespace {

// The deepest nesting of [ and { outside strings, and where it first passes `limit` (or -1).
int64_t first_byte_past_depth(const char* begin, const char* end, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char* p = begin; p != end; ++p) {
    const char c = *p;
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return p - begin;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return -1;
}

}  // namespace

nlohmann::json parse_json(const char* begin, const char* end, const std::string& op, const std::string& where) {
  const int64_t at = first_byte_past_depth(begin, end, kMaxJsonDepth);
  if (at >= 0)
    throw Error(op, where, fmt::format("is not accepted: its JSON nests deeper than {} levels (at byte {})",
                                       kMaxJsonDepth, at));
  try {
    return nlohmann::json::parse(begin, end);
  } catch (const nlohmann::json::exception& e) {
    std::string why = e.what();
    if (why.size() > 200) why = why.substr(0, 200) + "…";
    throw Error(op, where, "is not valid JSON: " + why);
  }
}

std::string quote_json(const nlohmann::json& value, size_t max_chars) {
  // Only scalars and small containers are dumped whole; a big container is dumped element by
  // element until the budget runs out, so quoting costs O(max_chars), not O(size).
  if (!value.is_structured()) {
    std::string s = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (s.size() > max_chars) s = s.substr(0, max_chars) + fmt::format("…\" (a string of {} bytes)", value.is_string() ? value.get_ref<const std::string&>().size() : s.size());
    return s;
  }
  const bool array = value.is_array();
  std::string s = array ? "[" : "{";
  size_t shown = 0;
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (s.size() >= max_chars) break;
    if (shown++) s += ", ";
    if (!array) s += nlohmann::json(it.key()).dump() + ": ";
    s += quote_json(*it, max_chars - std::min(max_chars, s.size()) + 8);
  }
  if (shown < value.size() || s.size() > max_chars + 16)
    return s.substr(0, max_chars) + fmt::format("…{} ({} of {} values)", array ? ']' : '}', array ? "an array" : "an object",
                                                value.size());
  return s + (array ? "]" : "}");
}

}  // namespace samebits

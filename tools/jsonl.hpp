// The JSONL inputs of the model tools: every non-blank line, numbered from 1.
#pragma once
#include <cstdint>
#include <istream>
#include <string>

#include <fmt/format.h>

#include "samebits/error.hpp"

namespace samebits::tools {

// Calls take(text, line_number) for every non-blank line of `in`; a read error throws
// samebits::Error(command, "--input", …). Returns the number of lines read.
template <class Take>
int64_t for_each_jsonl_line(std::istream& in, const std::string& command, Take&& take) {
  std::string text;
  int64_t number = 0;
  while (std::getline(in, text)) {
    ++number;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    take(text, number);
  }
  if (in.bad()) throw Error(command, "--input", fmt::format("read failed after line {}", number));
  return number;
}

}  // namespace samebits::tools

// `samebits verify` (tools/verify.cpp): returns 0 when every cell passes, 1 otherwise; throws
// samebits::Error for bad arguments or output that cannot be written. `doing` follows its stages,
// for an "out of memory while …" message.
#pragma once
#include <string>

#include "tools/cli.hpp"

namespace samebits::tools {

int run_verify(const VerifyRequest& args, std::string& doing);

}  // namespace samebits::tools

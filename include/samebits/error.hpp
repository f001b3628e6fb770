// samebits/error.hpp — the one error type. Its message names the op, the argument and the problem:
//   "samebits linear_forward: argument 'weight': shape [96, 160] does not match x's K = 128"
#pragma once
#include <stdexcept>
#include <string>

namespace samebits {

class Error : public std::runtime_error {
 public:
  Error(std::string op, std::string argument, std::string problem);
  const std::string& op() const { return op_; }
  const std::string& argument() const { return argument_; }
  const std::string& problem() const { return problem_; }

 private:
  std::string op_, argument_, problem_;
};

// Raised when a backend does not support a valid request by design (e.g. fp32 inputs to the CUDA
// GEMM). The harness reports such cells as not applicable.
class Unsupported : public Error {
 public:
  using Error::Error;
};

// A bad id found by a deferred check (Context::id_check = IdCheck::deferred) of an earlier call,
// raised by a later one: op() and argument() name the earlier call's.
class DeferredError : public Error {
 public:
  using Error::Error;
};

// Raised when an op has no implementation on the requested backend yet.
class NotBuilt : public Error {
 public:
  NotBuilt(std::string op, std::string backend);
};

}  // namespace samebits

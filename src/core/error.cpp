#include "samebits/error.hpp"

namespace samebits {

Error::Error(std::string op, std::string argument, std::string problem)
    : std::runtime_error("samebits " + op + ": argument '" + argument + "': " + problem),
      op_(std::move(op)), argument_(std::move(argument)), problem_(std::move(problem)) {}

NotBuilt::NotBuilt(std::string op, std::string backend)
    : Error(op, "context.backend",
            "not built yet for the " + backend + " backend (its kernels land in a later release)") {}

}  // namespace samebits

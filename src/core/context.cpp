#include "samebits/context.hpp"

#include <cstring>
#include <string>

#include "ops/registry.hpp"
#include "samebits/error.hpp"

namespace samebits {

#if SAMEBITS_WITH_CUDA
namespace cuda { bool device_present(); }
#endif

namespace detail {
DeferredErrorsFn& deferred_errors_of(Backend b) {
  static DeferredErrorsFn table[kNumBackends] = {};
  return table[static_cast<int>(b)];
}
}  // namespace detail

void raise_deferred_errors(Backend backend, bool wait) {
  if (auto raise = detail::deferred_errors_of(backend)) raise(wait);
}

const char* backend_name(Backend b) { return b == Backend::cpu ? "cpu" : "cuda"; }

Backend backend_from_name(const char* name) {
  if (std::strcmp(name, "cpu") == 0) return Backend::cpu;
  if (std::strcmp(name, "cuda") == 0) return Backend::cuda;
  throw Error("backend_from_name", "name", std::string("unknown backend '") + name + "'");
}

bool cuda_backend_built() {
#if SAMEBITS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_device_present() {
#if SAMEBITS_WITH_CUDA
  return cuda::device_present();
#else
  return false;
#endif
}

Backend choose_backend(const char* choice, const char* who, const char* arg) {
  if (std::strcmp(choice, "auto") == 0) return cuda_device_present() ? Backend::cuda : Backend::cpu;
  if (std::strcmp(choice, "cpu") != 0 && std::strcmp(choice, "cuda") != 0)
    throw Error(who, arg, std::string("must be \"cpu\", \"cuda\" or \"auto\", not \"") + choice + "\"");
  const Backend b = backend_from_name(choice);
  if (b == Backend::cuda && !cuda_backend_built())
    throw Error(who, arg, "this build has no CUDA backend (nvcc was not found at build time)");
  if (b == Backend::cuda && !cuda_device_present())
    throw Error(who, arg, "cuda was asked for, but no CUDA device is visible");
  return b;
}

}  // namespace samebits

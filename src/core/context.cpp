#include "samebits/context.hpp"

#include <cstring>
#include <string>

#include "samebits/error.hpp"

namespace samebits {

#if SAMEBITS_WITH_CUDA
namespace cuda { bool device_present(); }
#endif

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

}  // namespace samebits

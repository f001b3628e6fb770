// Programmatic dependent launch (Hopper): a kernel launched with launch_after_previous may start
// (its CTAs become resident, its prologue runs) while the kernel before it in the stream is still
// finishing; it must call pdl_wait() in every thread before its first global-memory access, which
// returns once that kernel has completed and its writes are visible — but for data that kernel
// cannot have written (the GEMM's settled weights: sm90_gemm_kernel.cuh). A kernel that calls
// pdl_launch_dependents() lets such a successor be scheduled from then on (without the call, at
// its end). Neither changes what any thread computes: only when the successor's CTAs start. In a
// CUDA graph the attribute becomes a programmatic edge.
//
// Why: a decode step is ~400 kernels of a few to a few tens of µs; each one's launch and ramp (a
// GEMM's CTAs starting, their barriers set up) used to begin only after the previous one's last
// CTA ended. SAMEBITS_PDL=0 in the environment launches every kernel plainly (for A/B runs).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "cuda/common/runtime.cuh"
#include "ops/tuning.hpp"

namespace samebits::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A switch for A/B runs: false where the environment sets `name` to "0" (callers keep it in a
// static: read once) — the kernels' SAMEBITS_* switches (grep env_switch).
inline bool env_switch(const char* name) {
  const char* v = std::getenv(name);
  return !(v && std::strcmp(v, "0") == 0);
}

// The opposite default, for experiments left off: true only where the environment sets `name` to "1"
// (callers keep it in a static: read once).
inline bool env_opt_in(const char* name) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, "1") == 0;
}
// A switch with a test hook: the hook where set (1: on, -1: off), else the environment's word
// (env_switch's or env_opt_in's value).
inline bool hook_or_env(int hook, bool env) { return hook != 0 ? hook > 0 : env; }

// Whether launch_after_previous sets the attribute: a compute capability 9.0 device (the waits are
// compiled for sm_90a only; on another device the kernels come from the sm_80 PTX, which has
// none, so the attribute would let them read too early), and SAMEBITS_PDL not "0" (the test hook
// detail::programmatic_launch_override decides where set).
inline bool programmatic_launch_enabled(const char* op) {
  static const bool env_on = env_switch("SAMEBITS_PDL");
  static std::atomic<int> hopper[64] = {};  // 2: compute capability 9.0; 1: another
  const bool sm90 = once_per_device(hopper, op, [&] {
    int dev = 0, major = 0, minor = 0;
    check(cudaGetDevice(&dev), op, "device");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), op, "compute capability");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), op, "compute capability");
    return major == 9 && minor == 0 ? 2 : 1;
  }) == 2;
  return sm90 && hook_or_env(detail::programmatic_launch_override(), env_on);
}

// The launch configuration of a kernel allowed to start before the previous kernel in the stream
// ends (the kernel calls pdl_wait() first): the attribute where the stream and the device allow it
// (on the default streams — null, legacy, per-thread — a plain launch). `cluster` > 0: the grid is
// launched in thread-block clusters of that many CTAs along x (a second attribute, set whether or
// not the first is; the two combine, the cluster's CTAs starting together once they may start).
// Not copyable: the config points at its own attributes.
struct AfterPrevious {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attribute[2]{};
  AfterPrevious(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const char* op, bool allowed = true,
                unsigned cluster = 0) {
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attribute;
    const bool legacy = stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
    unsigned n = 0;
    if (allowed && !legacy && programmatic_launch_enabled(op)) {
      attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    if (cluster > 0) {
      attribute[n].id = cudaLaunchAttributeClusterDimension;
      attribute[n].val.clusterDim.x = cluster;
      attribute[n].val.clusterDim.y = 1;
      attribute[n].val.clusterDim.z = 1;
      ++n;
    }
    config.numAttrs = n;
  }
  AfterPrevious(const AfterPrevious&) = delete;
  AfterPrevious& operator=(const AfterPrevious&) = delete;
};

// kernel<<<grid, block, smem, stream>>>(args...) as AfterPrevious says.
template <class... Params, class... Args>
void launch_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                           const char* op, Args&&... args) {
  AfterPrevious launch(grid, block, smem, stream, op);
  check(cudaLaunchKernelEx(&launch.config, kernel, std::forward<Args>(args)...), op, "kernel launch");
}

// The same in thread-block clusters of `cluster` CTAs along x (grid.x a multiple of it).
template <class... Params, class... Args>
void launch_cluster_after_previous(void (*kernel)(Params...), unsigned cluster, dim3 grid, dim3 block, size_t smem,
                                   cudaStream_t stream, const char* op, Args&&... args) {
  AfterPrevious launch(grid, block, smem, stream, op, true, cluster);
  check(cudaLaunchKernelEx(&launch.config, kernel, std::forward<Args>(args)...), op, "kernel launch");
}

// The same for a kernel chosen at run time (a function pointer of no fixed type, its arguments as
// cudaLaunchKernel takes them).
inline void launch_after_previous(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                  const char* op, void** args, bool allowed = true) {
  AfterPrevious launch(grid, block, smem, stream, op, allowed);
  check(cudaLaunchKernelExC(&launch.config, kernel, args), op, "kernel launch");
}

}  // namespace samebits::cuda

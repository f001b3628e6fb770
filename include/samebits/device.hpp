// samebits/device.hpp — the little of device memory that callers and the harness need.
// On Backend::cpu these are plain host operations; on Backend::cuda they are cudaMalloc / cudaMemcpy
// on the current device (throwing NotBuilt when the CUDA backend was not compiled).
#pragma once
#include <cstddef>
#include <cstdint>

#include "samebits/context.hpp"

namespace samebits {

void* device_alloc(Backend backend, size_t bytes);
void device_free(Backend backend, void* ptr);
void copy_to_device(Backend backend, void* dst, const void* src, size_t bytes);
void copy_to_host(Backend backend, void* dst, const void* src, size_t bytes);
void copy_on_device(Backend backend, void* dst, const void* src, size_t bytes);
// `height` blocks of `width` bytes, block i from src + i·src_pitch to dst + i·dst_pitch (one call).
void copy_blocks_on_device(Backend backend, void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                           size_t width, size_t height);
void device_fill(Backend backend, void* ptr, int byte, size_t bytes);
// n rows of `row_bytes` bytes, in one launch: dst + dst_rows[i]·dst_pitch ← src + src_rows[i]·src_pitch
// (the int32 index arrays on the backend's device; the destination rows distinct, never overlapping
// the source). Asynchronous on the CUDA backend (the legacy default stream, like the ops).
void copy_rows_indexed(Backend backend, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                       const int32_t* dst_rows, const int32_t* src_rows, int64_t n);
void device_synchronize(Backend backend);
// Device memory samebits holds now (tensors and temporaries, from its own pool), and the most it
// held at once since the last reset (`reset` starts a new mark). 0 on the CPU backend.
size_t device_memory_in_use(Backend backend);
size_t device_memory_peak(Backend backend, bool reset);
// Returns the memory samebits keeps for reuse but does not use now to the device (synchronises it
// first), for a process that shares the GPU with another allocator. Nothing on the CPU backend.
void device_memory_release(Backend backend);
// The device's free and total memory now (cudaMemGetInfo), plus what samebits' pool holds unused
// in `free`. 0 and 0 on the CPU backend.
void device_memory_info(Backend backend, size_t* free, size_t* total);

}  // namespace samebits

// SAMEBITS_HD: a function compiled for the host and, under nvcc, for the device too — arithmetic or
// indexing the CPU reference (or a CPU test) and a CUDA kernel share word for word.
#pragma once

#if defined(__CUDACC__)
#define SAMEBITS_HD __host__ __device__ __forceinline__
#else
#define SAMEBITS_HD inline
#endif

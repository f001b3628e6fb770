// Device-side range checks of integer ids (token ids, targets) before a kernel indexes with them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "samebits/context.hpp"

namespace samebits::cuda {

// Finds the first id of an active row (mask null or mask[i] != 0; ids equal to `allowed` skipped
// when has_allowed) outside [0, hi) and reports it as samebits::Error(op, name, "value V at index I
// is outside [0, hi)"): the same words as the CPU validator.
//  ctx.id_check == wait: synchronises the stream to read the answer, so it throws before the op
//    writes anything.
//  ctx.id_check == deferred: the answer lands in mapped host memory and is raised by a later op
//    (raise_deferred_errors), with ctx.id_note after it; this call returns at once. While the
//    ring of answers is full (more than 1024 checks queued and not yet run) it waits instead.
// Under CUDA graph capture it cannot read an answer and is skipped. Either way the kernels
// themselves never read through an id outside the range (they write NaN or leave the row out).
void require_ids_in_range(const Context& ctx, const char* op, const char* name, const int32_t* ids, int64_t n,
                          int64_t hi, const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream);
// The same for int64 ids (torch's default index type: no narrowing copy before the op).
void require_ids_in_range(const Context& ctx, const char* op, const char* name, const int64_t* ids, int64_t n,
                          int64_t hi, const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream);

// One deferred check's answer, written by the block that searched into mapped host memory: index
// and value, a system-scope fence, then the ticket that says the answer is there.
struct DeferredAnswer {
  int64_t index, value;
  uint64_t ticket, unused;
};
// Where a deferred check's search writes (answer null: no deferred check queued).
struct DeferredSlot {
  DeferredAnswer* answer = nullptr;
  uint64_t ticket = 0;
};

// For a kernel that runs the search itself in one extra block (one launch, not two): a deferred
// check of n ids against [0, hi) queued under ctx (no mask, no allowed id), its slot returned — or an
// empty slot where none was queued (ctx waits, the ring is full, or the stream is being captured):
// the caller then calls require_ids_in_range, which waits or skips as above.
DeferredSlot queue_deferred_search(const Context& ctx, const char* op, const char* name, int64_t n, int64_t hi,
                                   cudaStream_t stream);
// For a caller whose launch failed after queue_deferred_search: the slot is heard as "no bad id"
// (the call fails anyway), so the checks queued after it are heard.
void abandon_deferred_search(DeferredSlot slot);

#ifdef __CUDACC__
// The search, run by one block of THREADS threads: each thread keeps the lowest bad index of its
// stride, then a shared-memory tree takes the minimum (exact, so no order question). No atomics.
// The answer goes to out[0..1] (index, value; index n: none) or, with a slot, into the slot.
template <int THREADS, class Id>
__device__ void first_bad_id_block(const Id* ids, int64_t n, int64_t hi, const uint8_t* mask, bool has_allowed,
                                   int32_t allowed, int64_t* out, DeferredSlot slot) {
  __shared__ int64_t best[THREADS];
  int64_t first = n;
  for (int64_t i = threadIdx.x; i < n && first == n; i += THREADS) {
    if (mask && mask[i] == 0) continue;
    const int64_t v = ids[i];
    if (has_allowed && v == allowed) continue;
    if (v < 0 || v >= hi) first = i;
  }
  best[threadIdx.x] = first;
  __syncthreads();
  for (int half = THREADS / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) best[threadIdx.x] = min(best[threadIdx.x], best[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  const int64_t index = best[0], value = best[0] < n ? ids[best[0]] : 0;
  if (slot.answer == nullptr) {
    out[0] = index;
    out[1] = value;
    return;
  }
  volatile DeferredAnswer* a = slot.answer;
  a->index = index;
  a->value = value;
  __threadfence_system();  // the host sees the ticket only after the answer
  a->ticket = slot.ticket;
}
#endif

}  // namespace samebits::cuda

// The first out-of-range id, found by one block: each thread keeps the lowest bad index of its
// stride, then a shared-memory tree takes the minimum (exact, so no order question). No atomics.
//
// Two ways to hear the answer (Context::id_check):
//  * wait: the block writes it to scratch; the host copies it back and synchronises the stream.
//  * deferred: the block writes it into a slot of a ring in mapped, pinned host memory — index and
//    value first, then, after a system-scope fence, the check's ticket — and the host reads the
//    slots whose check it queued at the start of the next op (raise_deferred_id_errors). A slot
//    without its ticket yet is a check still queued: it is left for a later op, never waited for.
//    A slot is reused only once the check that held it has reported; while the ring is full, a
//    check waits as in `wait` mode (which also lets the stream's earlier checks report).
#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "cuda/common/index_check.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "ops/registry.hpp"

namespace samebits::cuda {
namespace {

constexpr int THREADS = 1024;

// One deferred check's answer, written by its kernel into mapped host memory.
struct Slot {
  int64_t index, value;
  uint64_t ticket, unused;
};

__global__ void first_bad_id(const int32_t* ids, int64_t n, int64_t hi, const uint8_t* mask, bool has_allowed,
                             int32_t allowed, int64_t* out, Slot* slot, uint64_t ticket) {
  __shared__ int64_t best[THREADS];
  int64_t first = n;
  for (int64_t i = threadIdx.x; i < n && first == n; i += THREADS) {
    if (mask && mask[i] == 0) continue;
    const int32_t v = ids[i];
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
  if (slot == nullptr) {
    out[0] = index;
    out[1] = value;
    return;
  }
  volatile Slot* s = slot;
  s->index = index;
  s->value = value;
  __threadfence_system();  // the host sees the ticket only after the answer
  s->ticket = ticket;
}

std::string outside(int64_t value, int64_t index, int64_t hi) {
  return "value " + std::to_string(value) + " at index " + std::to_string(index) + " is outside [0, " +
         std::to_string(hi) + ")";
}

// The deferred checks queued and not yet heard from, and the ring their answers land in.
constexpr uint64_t RING = 1024;
struct Queued {
  const char *op, *name;
  int64_t n, hi;
  std::string note;
};
struct Deferred {
  std::mutex mutex;
  Slot* ring = nullptr;  // mapped, pinned, portable host memory (UVA: the same address on every GPU); kept for the process
  uint64_t next_ticket = 1;
  std::map<uint64_t, Queued> queued;  // by ticket
  std::atomic<bool> any{false};
};
Deferred& deferred() {
  static Deferred d;
  return d;
}

// The earliest-queued bad answer among those that landed (found == false: none).
struct Found {
  bool found = false;
  std::string op, name, problem;
  [[noreturn]] void raise() const { throw Error(op, name, problem); }
};

// Reads the answers that have landed and forgets their checks. Caller holds the mutex.
Found collect_locked(Deferred& d) {
  Found error;
  for (auto it = d.queued.begin(); it != d.queued.end();) {
    const volatile Slot& s = d.ring[it->first % RING];
    if (s.ticket != it->first) {
      ++it;
      continue;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    const int64_t index = s.index, value = s.value;
    if (index < it->second.n && !error.found)
      error = {true, it->second.op, it->second.name,
               outside(value, index, it->second.hi) +
                   " (found after that call returned: ids in GPU memory are checked without waiting for the GPU, "
                   "and a bad one is reported by the next samebits op)" + it->second.note};
    it = d.queued.erase(it);
  }
  d.any.store(!d.queued.empty(), std::memory_order_relaxed);
  return error;
}

void raise_deferred_id_errors() {
  Deferred& d = deferred();
  if (!d.any.load(std::memory_order_relaxed)) return;
  Found error;
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    error = collect_locked(d);
  }
  if (error.found) error.raise();
}

const bool registered = [] {
  detail::deferred_errors_of(Backend::cuda) = &raise_deferred_id_errors;
  return true;
}();

// Queues a deferred check; false when its ring slot is still held (the caller then waits instead).
bool queue_deferred(const Context& ctx, const char* op, const char* name, const int32_t* ids, int64_t n, int64_t hi,
                    const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream) {
  Deferred& d = deferred();
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.ring == nullptr) {
    void* ring = nullptr;
    check(cudaHostAlloc(&ring, RING * sizeof(Slot), cudaHostAllocMapped | cudaHostAllocPortable), op,
          "pinned memory for the deferred id checks");
    d.ring = static_cast<Slot*>(ring);
    for (uint64_t i = 0; i < RING; ++i) d.ring[i].ticket = 0;
  }
  const uint64_t ticket = d.next_ticket;
  if (!d.queued.empty() && d.queued.begin()->first + RING <= ticket) {
    const Found error = collect_locked(d);  // a slot frees when its answer has landed
    if (error.found) error.raise();
    if (!d.queued.empty() && d.queued.begin()->first + RING <= ticket) return false;
  }
  Slot* slot = &d.ring[ticket % RING];
  Slot* device_slot = nullptr;
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_slot), slot, 0), op, "deferred id check slot");
  first_bad_id<<<1, THREADS, 0, stream>>>(ids, n, hi, mask, has_allowed, allowed, nullptr, device_slot, ticket);
  check(cudaGetLastError(), op, "id check launch");
  d.queued.emplace(ticket, Queued{op, name, n, hi, ctx.id_note ? ctx.id_note : ""});
  d.next_ticket = ticket + 1;
  d.any.store(true, std::memory_order_relaxed);
  return true;
}

}  // namespace

void require_ids_in_range(const Context& ctx, const char* op, const char* name, const int32_t* ids, int64_t n,
                          int64_t hi, const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream) {
  (void)registered;
  if (n <= 0) return;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &capturing), op, "stream capture status");
  if (capturing != cudaStreamCaptureStatusNone) return;
  if (ctx.id_check == IdCheck::deferred &&
      queue_deferred(ctx, op, name, ids, n, hi, mask, has_allowed, allowed, stream))
    return;
  auto* scratch = static_cast<int64_t*>(scratch_alloc(2 * sizeof(int64_t), stream, op));
  first_bad_id<<<1, THREADS, 0, stream>>>(ids, n, hi, mask, has_allowed, allowed, scratch, nullptr, 0);
  int64_t found[2] = {n, 0};
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t copied = cudaMemcpyAsync(found, scratch, sizeof(found), cudaMemcpyDeviceToHost, stream);
  scratch_free(scratch, stream, op);
  check(launched, op, "id check launch");
  check(copied, op, "id check copy");
  check(cudaStreamSynchronize(stream), op, "id check");
  if (found[0] < n) throw Error(op, name, outside(found[1], found[0], hi));
}

}  // namespace samebits::cuda

// Range checks of ids in device memory: a one-block search (index_check.cuh), and the two ways to
// hear its answer (Context::id_check):
//  * wait: the block writes it to scratch; the host copies it back and synchronises the stream.
//  * deferred: the block writes it into a slot of a ring in mapped, pinned host memory, and the host
//    reads the slots of the checks it queued when a later op is entered (raise_deferred_id_errors).
//    Checks are heard in the order they were queued: the host stops at the first whose ticket has
//    not landed (a check still queued on a stream is never waited for, unless asked: wait = true),
//    so an error may wait for an earlier check on another stream. Every bad answer heard is kept
//    and raised, one a call. A slot is reused only once its check has been heard; while the ring is
//    full, a check waits as in `wait` mode.
#include <atomic>
#include <climits>
#include <deque>
#include <mutex>
#include <string>

#include "cuda/common/index_check.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "ops/registry.hpp"

namespace samebits::cuda {
namespace {

constexpr int THREADS = 1024;

template <class Id>
__global__ void first_bad_id(const Id* ids, int64_t n, int64_t hi, const uint8_t* mask, bool has_allowed,
                             int32_t allowed, int64_t* out, DeferredSlot slot) {
  first_bad_id_block<THREADS>(ids, n, hi, mask, has_allowed, allowed, out, slot);
}

std::string outside(int64_t value, int64_t index, int64_t hi) {
  return "value " + std::to_string(value) + " at index " + std::to_string(index) + " is outside [0, " +
         std::to_string(hi) + ")";
}

// The deferred checks queued and not yet heard from (tickets [oldest, next)), and the ring their
// answers land in: ticket t in slot t % RING.
constexpr uint64_t RING = 1024;
struct Queued {
  const char *op, *name, *note;  // note: Context::id_note (a literal)
  int64_t n, hi;
  int device;  // where its kernel runs (wait = true synchronises it)
};
// A bad answer heard and not yet raised.
struct Found {
  std::string op, name, problem;
};
struct Deferred {
  std::mutex mutex;
  DeferredAnswer* ring = nullptr;         // mapped, pinned, portable host memory, kept for the process
  DeferredAnswer* device_ring = nullptr;  // its address for kernels (UVA: the same on every GPU)
  Queued queued[RING];
  uint64_t oldest = 1, next = 1;
  std::deque<Found> found;
  std::atomic<bool> any{false};  // checks queued or errors heard: the lock-free fast path of an op's entry
};
Deferred& deferred() {
  static Deferred d;
  return d;
}

// Hears the answers that have landed, in queue order, keeping the bad ones. Caller holds the mutex.
void hear_locked(Deferred& d) {
  for (; d.oldest < d.next; ++d.oldest) {
    const volatile DeferredAnswer& a = d.ring[d.oldest % RING];
    if (a.ticket != d.oldest) break;
    std::atomic_thread_fence(std::memory_order_acquire);
    const Queued& q = d.queued[d.oldest % RING];
    const int64_t index = a.index, value = a.value;
    if (index < q.n)
      d.found.push_back({q.op, q.name,
                         outside(value, index, q.hi) +
                             " (found after that call returned: ids in GPU memory are checked without waiting for the "
                             "GPU, and a bad one is reported by a later samebits op)" + q.note});
  }
  d.any.store(d.oldest < d.next || !d.found.empty(), std::memory_order_relaxed);
}

void raise_deferred_id_errors(bool wait) {
  Deferred& d = deferred();
  if (!d.any.load(std::memory_order_relaxed)) return;
  std::unique_lock<std::mutex> lock(d.mutex);
  hear_locked(d);
  while (wait && d.oldest < d.next) {  // the oldest unheard check's device, synchronised (unlocked)
    const int device = d.queued[d.oldest % RING].device;
    lock.unlock();
    int current = 0;
    check(cudaGetDevice(&current), "raise_deferred_errors", "current device");
    check(cudaSetDevice(device), "raise_deferred_errors", "device of a queued check");
    const cudaError_t synced = cudaDeviceSynchronize();
    cudaSetDevice(current);
    check(synced, "raise_deferred_errors", "waiting for a queued check");
    lock.lock();
    hear_locked(d);
  }
  if (d.found.empty()) return;
  const Found f = d.found.front();
  d.found.pop_front();
  d.any.store(d.oldest < d.next || !d.found.empty(), std::memory_order_relaxed);
  lock.unlock();
  throw DeferredError(f.op, f.name, f.problem);
}

const bool registered = [] {
  detail::deferred_errors_of(Backend::cuda) = &raise_deferred_id_errors;
  return true;
}();

// queue_deferred_search past its checks of the mode, n and capture (the caller made them).
DeferredSlot queue(const Context& ctx, const char* op, const char* name, int64_t n, int64_t hi) {
  (void)registered;
  // An error left by earlier work: the caller's launch check could not tell it from its own launch's,
  // and a launch taken for failed would leave its slot to be written late. Wait mode instead.
  if (cudaPeekAtLastError() != cudaSuccess) return {};
  int device = 0;
  check(cudaGetDevice(&device), op, "current device");
  Deferred& d = deferred();
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.ring == nullptr) {
    void* ring = nullptr;
    check(cudaHostAlloc(&ring, RING * sizeof(DeferredAnswer), cudaHostAllocMapped | cudaHostAllocPortable), op,
          "pinned memory for the deferred id checks");
    void* device_ring = nullptr;
    if (const cudaError_t mapped = cudaHostGetDevicePointer(&device_ring, ring, 0); mapped != cudaSuccess) {
      cudaFreeHost(ring);
      check(mapped, op, "the deferred id checks' device address");
    }
    for (uint64_t i = 0; i < RING; ++i) static_cast<DeferredAnswer*>(ring)[i].ticket = 0;
    d.ring = static_cast<DeferredAnswer*>(ring);
    d.device_ring = static_cast<DeferredAnswer*>(device_ring);
  }
  if (d.next - d.oldest >= RING) {
    hear_locked(d);  // a slot frees once its answer is heard (a bad one is kept for the next op's entry)
    if (d.next - d.oldest >= RING) return {};
  }
  const uint64_t ticket = d.next++;
  d.queued[ticket % RING] = Queued{op, name, ctx.id_note ? ctx.id_note : "", n, hi, device};
  d.any.store(true, std::memory_order_relaxed);
  return {&d.device_ring[ticket % RING], ticket};
}

}  // namespace

DeferredSlot queue_deferred_search(const Context& ctx, const char* op, const char* name, int64_t n, int64_t hi,
                                   cudaStream_t stream) {
  if (ctx.id_check != IdCheck::deferred || n <= 0 || stream_capturing(stream, op)) return {};
  return queue(ctx, op, name, n, hi);
}

void abandon_deferred_search(DeferredSlot slot) {
  if (slot.answer == nullptr) return;
  Deferred& d = deferred();
  std::lock_guard<std::mutex> lock(d.mutex);
  volatile DeferredAnswer& a = d.ring[slot.ticket % RING];
  a.index = INT64_MAX;  // heard as "no bad id": the call that queued it has failed already
  a.ticket = slot.ticket;
}

namespace {
template <class Id>
void require_in_range(const Context& ctx, const char* op, const char* name, const Id* ids, int64_t n, int64_t hi,
                      const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream) {
  if (n <= 0 || stream_capturing(stream, op)) return;
  if (const DeferredSlot slot = ctx.id_check == IdCheck::deferred ? queue(ctx, op, name, n, hi) : DeferredSlot{};
      slot.answer) {
    first_bad_id<<<1, THREADS, 0, stream>>>(ids, n, hi, mask, has_allowed, allowed, nullptr, slot);
    if (const cudaError_t launched = cudaGetLastError(); launched != cudaSuccess) {
      abandon_deferred_search(slot);
      check(launched, op, "id check launch");
    }
    return;
  }
  auto* scratch = static_cast<int64_t*>(scratch_alloc(2 * sizeof(int64_t), stream, op));
  first_bad_id<<<1, THREADS, 0, stream>>>(ids, n, hi, mask, has_allowed, allowed, scratch, DeferredSlot{});
  int64_t found[2] = {n, 0};
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t copied = cudaMemcpyAsync(found, scratch, sizeof(found), cudaMemcpyDeviceToHost, stream);
  scratch_free(scratch, stream, op);
  check(launched, op, "id check launch");
  check(copied, op, "id check copy");
  check(cudaStreamSynchronize(stream), op, "id check");
  if (found[0] < n) throw Error(op, name, outside(found[1], found[0], hi));
}

}  // namespace

void require_ids_in_range(const Context& ctx, const char* op, const char* name, const int32_t* ids, int64_t n,
                          int64_t hi, const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream) {
  require_in_range(ctx, op, name, ids, n, hi, mask, has_allowed, allowed, stream);
}

void require_ids_in_range(const Context& ctx, const char* op, const char* name, const int64_t* ids, int64_t n,
                          int64_t hi, const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream) {
  require_in_range(ctx, op, name, ids, n, hi, mask, has_allowed, allowed, stream);
}

}  // namespace samebits::cuda

// samebits/context.hpp — where and how an op runs.
#pragma once
#include <cstddef>

namespace samebits {

enum class Backend : unsigned char { cpu = 0, cuda = 1 };
constexpr int kNumBackends = 2;
const char* backend_name(Backend b);
Backend backend_from_name(const char* name);  // "cpu" | "cuda"; throws on anything else
bool cuda_backend_built();                     // compiled with nvcc
bool cuda_device_present();                    // built, and a GPU is visible
// A user's backend choice: "cpu", "cuda" (an Error naming `who` and `arg` when this build or this
// machine has none) or "auto" (the GPU when one is visible, else the CPU).
Backend choose_backend(const char* choice, const char* who, const char* arg);

// The CPU backend's two arithmetic modes.
//  fixed_fp32: fp32 accumulation in a reduction order fixed by the reduced extent only: the
//              batch-invariant CPU backend that users and CI run.
//  truth_fp64: fp64 arithmetic end to end (inputs and outputs in fp64): the accuracy ground truth.
enum class Precision : unsigned char { fixed_fp32, truth_fp64 };

// How the CUDA backend checks ids that sit in device memory (embedding ids, logprob targets) before
// its kernels index with them.
//  wait:     a check kernel whose answer the host waits for (a stream synchronisation: the host
//            waits for every kernel queued before it), so a bad id throws from the call itself,
//            before anything is written.
//  deferred: the check kernel runs in the stream and the host goes on. A bad id throws from the
//            next samebits op called on the CUDA backend (any op) or from raise_deferred_errors(),
//            naming the call that got it; until then that call's outputs hold NaN for it (the
//            embedding's row, the token's logprob). samebits.torch runs so: like a torch op it
//            never waits on the GPU, and unlike one a bad id leaves the CUDA context usable.
enum class IdCheck : unsigned char { wait, deferred };

struct Context {
  Backend backend = Backend::cpu;
  Precision precision = Precision::fixed_fp32;
  void* stream = nullptr;           // cudaStream_t on the CUDA backend; unused on the CPU
  void* workspace = nullptr;        // caller-owned scratch memory on the backend's device
  size_t workspace_bytes = 0;
  bool check_finite_inputs = true;  // reject NaN / Inf in floating inputs with an Error
  // Debug aid: the model chain fills every activation with 0xFF bytes (NaN) before the op that
  // writes it, so an unwritten element shows as NaN. The chain gate turns it on; it costs a fill
  // of every activation (3% of a training step, a sixth of a decode step on an H100).
  bool poison_activations = false;
  IdCheck id_check = IdCheck::wait;
  const char* id_note = "";  // deferred: appended to a bad id's message (a literal: kept by pointer; samebits.torch: why a value reads as an int32 bound)
};

// Throws the DeferredError of a deferred id check (IdCheck::deferred) that found a bad id, one a
// call, the earliest queued first; nothing on a backend without deferred checks. wait = false:
// only checks whose answer has landed are heard (every op on the CUDA backend calls it so on
// entry; ops that other ops call inside them do not). wait = true: first waits for every queued
// check's GPU (each device's work, on every device a check was queued on).
void raise_deferred_errors(Backend backend, bool wait = false);

}  // namespace samebits

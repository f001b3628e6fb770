// Test hooks for kernel shape choices. Production code never sets them; tests force each choice to
// prove that the choices give identical bits.
#pragma once

namespace samebits::detail {

// 0: the GEMM picks its tile width itself; 64, 128, 192 or 256: forced (tests/test_cuda_gemm.cpp).
int& gemm_tile_width_override();

// 0: the fused LM head's backward picks its vocab chunk itself; else the chunk width in columns (a
// multiple of 256; tests/test_cuda_lm_head.cpp).
int& lm_head_vocab_chunk_override();

// false: the CUDA RMSNorm kernels take their compile-time-bf16 instance where every row tensor is
// bf16; true: always the run-time-dtype instance (the same bits; tests/test_cuda_norm_rope.cpp).
bool& norm_any_dtype_path_override();

// 0: programmatic dependent launches where the device and SAMEBITS_PDL allow them
// (cuda/common/pdl.cuh); 1: wherever the device allows them; -1: never (tests compare the two).
int& programmatic_launch_override();

// 0: the persistent attention kernels (the single-span kernel of decode steps; the paired prefill
// kernel) run at most one CTA an SM; N > 0: at most N CTAs, each walking many items
// (tests/cuda/test_attention.cpp: the same bits).
int& attention_persistent_ctas_override();

// The CUDA sampling kernel (tests/cuda/test_sampling.cpp, bench_time_sampling: the same bits either
// way): 0, the schedule (a thread-block cluster a row where the device allows it and the call's
// clusters fit the SMs at once, else one CTA a row); 1, always one CTA a row (the kernel of other
// devices); 2, the cluster kernel wherever the device allows it, whatever the row count.
int& sampling_kernel_override();

// The gate + up GEMM with a SwiGLU output (LinearGroupForwardArgs::swiglu) on a Hopper GPU: 0, as
// SAMEBITS_FUSED_SWIGLU says (off unless "1": not yet measured on a GPU); 1, the fused launch wherever
// it takes the call; -1, never (the parts, then swiglu_forward). The same bits either way
// (tests/cuda/test_linear.cpp).
int& fused_swiglu_override();
// Fused gate + up + SwiGLU launches so far (tests: proof that the fused kernel ran, not the parts).
long long& fused_swiglu_launches();

// The decode attention's 16-row kernel (mma.sync; cuda/attention/attention_forward_sm90.cu) for calls
// whose items are all one span of at most 16 rows: 0, as SAMEBITS_NARROW_DECODE says (off unless "1":
// not yet measured on a GPU); 1, wherever it takes the call; -1, never (the 64-row wgmma kernel). The
// same bits either way (tests/cuda/test_attention.cpp).
int& narrow_decode_override();
// Launches of the 16-row kernel so far (tests: proof that it ran).
long long& narrow_decode_launches();

// The paired persistent attention kernel (cuda/attention/attention_forward_sm90.cu: two consumers a
// CTA, the CTAs walking the items) for calls with items of more than 64 rows (prefill): 0, as
// SAMEBITS_PERSISTENT_PREFILL says (on unless "0"); 1, wherever it takes
// the call; -1, never (a CTA an item). The same bits either way (tests/cuda/test_attention.cpp).
int& persistent_prefill_override();
// Launches of the paired kernel so far (tests: proof that it ran).
long long& persistent_prefill_launches();

// The Hopper attention's wgmma kernels issuing a block's P·V during the next block's softmax: 0, as
// SAMEBITS_ATTENTION_OVERLAP says (the prefill kernels unless "0"; never the decode kernel); 1, in
// every wgmma kernel, the decode kernel's too; -1, never. The same bits either way (tests/cuda/test_attention.cpp).
int& attention_overlap_override();
// Launches with the overlap so far (tests: proof that it ran).
long long& attention_overlap_launches();

// A hook set for a scope's life (tests): its earlier value comes back at the scope's end, after a
// failed check too.
template <class T>
class ScopedOverride {
 public:
  ScopedOverride(T& hook, T value) : hook_(hook), earlier_(hook) { hook_ = value; }
  ~ScopedOverride() { hook_ = earlier_; }
  ScopedOverride(const ScopedOverride&) = delete;
  ScopedOverride& operator=(const ScopedOverride&) = delete;

 private:
  T& hook_;
  T earlier_;
};

}  // namespace samebits::detail

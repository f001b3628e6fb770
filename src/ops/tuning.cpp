#include "ops/tuning.hpp"

namespace samebits::detail {

int& gemm_tile_width_override() {
  static int width = 0;
  return width;
}

int& lm_head_vocab_chunk_override() {
  static int width = 0;
  return width;
}

bool& norm_any_dtype_path_override() {
  static bool value = false;
  return value;
}

int& programmatic_launch_override() {
  static int value = 0;
  return value;
}

int& fused_swiglu_override() {
  static int value = 0;
  return value;
}

long long& fused_swiglu_launches() {
  static long long count = 0;
  return count;
}

int& narrow_decode_override() {
  static int value = 0;
  return value;
}

long long& narrow_decode_launches() {
  static long long count = 0;
  return count;
}

int& persistent_prefill_override() {
  static int value = 0;
  return value;
}

long long& persistent_prefill_launches() {
  static long long count = 0;
  return count;
}

int& attention_overlap_override() {
  static int value = 0;
  return value;
}

long long& attention_overlap_launches() {
  static long long count = 0;
  return count;
}

int& sampling_kernel_override() {
  static int value = 0;
  return value;
}

int& attention_persistent_ctas_override() {
  static int value = 0;
  return value;
}

}  // namespace samebits::detail

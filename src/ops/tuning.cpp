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

int& norm_rows_per_step_override() {
  static int rows = 0;
  return rows;
}

}  // namespace samebits::detail

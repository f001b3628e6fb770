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

}  // namespace samebits::detail

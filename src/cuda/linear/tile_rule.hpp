// The Hopper GEMM's tile widths (cuda/linear/gemm_sm90.cu, tile_choice): which output-column width a
// call's tiles take, from M, the columns and the SM count. The width never changes an element's bits
// (every width runs an element's same K sequence: TileWidthsGiveIdenticalBits), only how evenly the
// SMs share the weight; tests/cpu/test_tile_rule.cpp checks the rule on the model layers' shapes.
#pragma once
#include <cstdint>

namespace samebits::cuda::gemm_tiles {

// The output columns one launch covers, `count` products side by side (one for a plain GEMM): a tile
// never straddles two products, so each product's columns round up to the tile width on their own.
struct Columns {
  const int64_t* N;
  int count;
  int64_t total() const {
    int64_t n = 0;
    for (int g = 0; g < count; ++g) n += N[g];
    return n;
  }
  int64_t tiles(int width) const {
    int64_t t = 0;
    for (int g = 0; g < count; ++g) t += (N[g] + width - 1) / width;
    return t;
  }
};
inline int64_t tile_rounds(int64_t M, const Columns& cols, int width, int sms) {
  const int64_t tiles = ((M + 127) / 128) * cols.tiles(width);
  return (tiles + sms - 1) / sms;
}
// Wide outputs at 64 < M <= 256 (a few rows of tiles, the weight streamed: the time is the busiest
// CTA's columns, as at decode sizes) take 192-wide tiles where the busiest CTA then streams fewer
// columns than with 256-wide ones: at M <= 128, whose outputs go out by the threads' own stores, by
// any margin, the wider on a tie — Qwen3-8B's gate + up at M = 128, 128 tiles of 192 instead of 96 of
// 256 (36 of 132 SMs idle), and its LM head, ⌈792 / 132⌉ × 192 = 1152 columns instead of
// ⌈594 / 132⌉ × 256 = 1280 (H200, 256-wide: 0.93× and 0.90× cuBLAS); above M = 128, where TMA
// stores them and a 192-wide tile has room for one store box a consumer, not two, by the 10% margin
// that M > 256 takes (gemm_sm90.cu's design note: where the saving was small, 192 lost there).
inline int tile_width(int64_t M, const Columns& cols, int sms) {
  int width = cols.total() >= 16384 ? 256 : M <= 256 ? 64 : M <= 512 ? 128 : 256;
  if (M > 256 || width == 256) {
    const int64_t with_192 = 192 * tile_rounds(M, cols, 192, sms);
    const int64_t with_width = width * tile_rounds(M, cols, width, sms);
    if (M <= 128 ? with_192 < with_width : 10 * with_192 < 9 * with_width) width = 192;
  }
  return width;
}

// Decode-sized calls (M <= 64: one row of compact 64-row tiles) stream the weight and want every SM
// streaming an equal share of it, each with as deep a ring as possible: the narrowest of 32 and 48
// (forward only) whose tiles fit one round (down and O, 4096 columns: 128 tiles of 32; QKV, 4096 +
// 1024 + 1024: 130 of 48), else the one of 64, 192 and 256 whose busiest CTA streams the fewest
// columns, ⌈tiles / SMs⌉ x width, the widest on a tie (gate + up of Qwen3-8B, 2 x 12288: 128 tiles of
// 192, not 96 of 256, which left 36 of 132 SMs idle: 1.05x on an H200; its LM head 192, ⌈792 / 132⌉
// x 192 = 1152 columns, not 1280: 1.02x; Llama-3's gate + up and LM head stay 256). Narrow tiles that
// need several rounds measured slower than that count says (32-wide: Llama-3's gate + up 0.93x, its
// LM head 0.86x against 256-wide tiles), so they are not candidates. For 64 < M <= 128, two 64-row
// tiles of 64 columns where they fit one round (down, O: 128 CTAs instead of 64). dX reads w along
// its output columns in 128-byte boxes, or 64-byte ones for a 32-wide tile, so its tiles are 32 or
// at least 64 wide (dX of gate+up and the LM heads, 4096 output columns: 128 tiles of 32). Measured
// against 64-wide tiles only, same run: forward M <= 128 on an H100, geometric-mean ratio to cuBLAS
// 1.045 -> 1.122 (down M = 16: 1.07 -> 1.61), dX 1.024 -> 1.063; the 32-wide dX tiles on an H200, dX
// M <= 128 0.922 -> 0.956.
inline int decode_width(const Columns& cols, int sms, bool forward) {
  for (int w : {32, 48})  // the narrowest whose 64-row tiles fit one round
    if (cols.tiles(w) <= sms && (forward || w == 32)) return w;
  int width = 256;
  int64_t best = -1;
  for (int w : {256, 192, 64}) {
    const int64_t busiest = (cols.tiles(w) + sms - 1) / sms * w;  // columns the busiest CTA streams
    if (best < 0 || busiest < best) best = busiest, width = w;
  }
  return width;
}

}  // namespace samebits::cuda::gemm_tiles

// The Hopper GEMM's tile-width rule (cuda/linear/tile_rule.hpp) on the model layers' shapes, 132 SMs
// (H100 SXM and H200): the widths the design notes name, and at decode sizes no candidate whose busiest
// CTA would stream fewer weight columns than the chosen one. The width never changes a bit; what this
// guards is the speed the notes measured.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "cuda/linear/tile_rule.hpp"

namespace samebits::cuda::gemm_tiles {
namespace {

constexpr int SMS = 132;

int width_of(int64_t M, std::vector<int64_t> N) { return tile_width(M, Columns{N.data(), int(N.size())}, SMS); }
int decode_of(std::vector<int64_t> N, bool forward = true) {
  return decode_width(Columns{N.data(), int(N.size())}, SMS, forward);
}

TEST(TileRule, DecodeSizesTakeTheWidthsTheNotesMeasured) {
  EXPECT_EQ(decode_of({4096}), 32);                // down and O: 128 tiles of 32, one round
  EXPECT_EQ(decode_of({4096, 1024, 1024}), 48);    // QKV: 130 tiles of 48
  EXPECT_EQ(decode_of({12288, 12288}), 192);       // Qwen3-8B gate + up: 128 tiles of 192, not 96 of 256
  EXPECT_EQ(decode_of({151936}), 192);             // Qwen3-8B LM head: 6 rounds of 192 (1152), not 5 of 256
  EXPECT_EQ(decode_of({14336, 14336}), 256);       // Llama-3-8B gate + up
  EXPECT_EQ(decode_of({128256}), 256);             // Llama-3-8B LM head
  EXPECT_EQ(decode_of({4096}, false), 32);         // dX: 32 or at least 64
  EXPECT_EQ(decode_of({4096, 1024, 1024}, false), 64);
}

TEST(TileRule, NoDecodeCandidateStreamsFewerColumnsThanTheChoice) {
  for (std::vector<int64_t> N : std::vector<std::vector<int64_t>>{
           {4096}, {4096, 1024, 1024}, {12288, 12288}, {14336, 14336}, {151936}, {128256}, {200, 40, 72}, {9000}}) {
    const Columns cols{N.data(), int(N.size())};
    const int w = decode_width(cols, SMS, true);
    auto busiest = [&](int width) { return (cols.tiles(width) + SMS - 1) / SMS * width; };
    if (w <= 48) {
      EXPECT_LE(cols.tiles(w), SMS) << cols.total();  // narrow tiles only where they fit one round
      continue;
    }
    for (int other : {64, 192, 256}) EXPECT_LE(busiest(w), busiest(other)) << cols.total() << " columns, " << other;
  }
}

TEST(TileRule, WideOutputsAtSmallMTake192WhereItStreamsLess) {
  // 64 < M <= 128 (the threads' stores): any saving.
  EXPECT_EQ(width_of(128, {12288, 12288}), 192);  // 128 tiles of 192 against 96 of 256
  EXPECT_EQ(width_of(128, {151936}), 192);        // 6 rounds × 192 = 1152 against 5 × 256 = 1280
  EXPECT_EQ(width_of(128, {14336, 14336}), 256);  // 112 tiles of 256: one round
  EXPECT_EQ(width_of(128, {128256}), 256);        // 4 rounds × 256 = 1024 against 6 × 192 = 1152
  // Narrow outputs keep 64 at M <= 256.
  EXPECT_EQ(width_of(128, {4096, 1024, 1024}), 64);
  EXPECT_EQ(width_of(256, {4096}), 64);
  // 128 < M (TMA stores): 192 only by a 10% saving.
  EXPECT_EQ(width_of(256, {12288, 12288}), 192);  // 2 rounds × 192 against 2 × 256
  EXPECT_EQ(width_of(256, {151936}), 256);        // 9 rounds × 256 = 12 × 192: a tie
  EXPECT_EQ(width_of(512, {6144}), 192);   // QKV as one product at M = 512 and 1024 (the design note's case)
  EXPECT_EQ(width_of(1024, {6144}), 192);  // 1.94 rounds of 192 against 1.45 of 256
}

}  // namespace
}  // namespace samebits::cuda::gemm_tiles

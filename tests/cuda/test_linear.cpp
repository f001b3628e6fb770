// CUDA GEMM invariance sweep (runs where a GPU is visible; skipped elsewhere): every M in 1…512 and
// sampled M up to 8192 (primes included), rows at offsets among different neighbours, N and K that
// are not tile multiples, all three products, bf16 and fp16, and 100 repeats of the same call.
#include <gtest/gtest.h>

#include <cstdio>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/captured_graph.hpp"
#include "ops/tuning.hpp"
#include "samebits/device.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"
#include "samebits/ops.hpp"
#include "tests/cuda/cuda_test_util.hpp"

namespace {

std::vector<int64_t> sweep_ms() {
  std::vector<int64_t> ms;
  for (int64_t m = 1; m <= 512; ++m) ms.push_back(m);
  for (int64_t m : {521, 1000, 1024, 1031, 2039, 2048, 3001, 4096, 4099, 6007, 8191, 8192}) ms.push_back(m);
  return ms;
}

// The rows [0, m) of y computed in a batch of `m` rows placed at `offset` inside a buffer full of
// other rows must equal the same rows computed in the full 8192-row batch.
void sweep_forward_and_dx(DType dt, int64_t N = 200, int64_t K = 136, std::vector<int64_t> ms = sweep_ms()) {
  const int64_t MAX = 8192;
  Rng r(17);
  const DeviceBuffer x(r.tensor(dt, {MAX, K}, -1, 1)), w(r.tensor(dt, {N, K}, -1, 1)),
      dy(r.tensor(dt, {MAX, N}, -1, 1));
  const DeviceBuffer y_ref(DType::f32, {MAX, N}), dx_ref(dt, {MAX, K});
  linear_forward(cuda_ctx(), {x.view(), w.view(), {}, y_ref.view()});
  linear_backward_input(cuda_ctx(), {dy.view(), w.view(), dx_ref.view()});
  const HostTensor y_want = y_ref.host(), dx_want = dx_ref.host();
  // A scratch copy whose rows around the target window hold other content.
  HostTensor xs = r.tensor(dt, {MAX + 64, K}, -3, 3), dys = r.tensor(dt, {MAX + 64, N}, -3, 3);
  const HostTensor x_host = x.host(), dy_host = dy.host();
  for (int64_t m : ms) {
    const int64_t off = (m * 37) % 64, src = (m * 131) % (MAX - m + 1);
    HostTensor xm = xs, dym = dys;
    xm.copy_rows_from(x_host, src, off, m);
    dym.copy_rows_from(dy_host, src, off, m);
    const DeviceBuffer xd(xm), dyd(dym), yd(DType::f32, {m, N}), dxd(dt, {m, K});
    linear_forward(cuda_ctx(), {xd.rows(off, off + m), w.view(), {}, yd.view()});
    linear_backward_input(cuda_ctx(), {dyd.rows(off, off + m), w.view(), dxd.view()});
    const HostTensor yg = yd.host(), dxg = dxd.host();
    ASSERT_EQ(std::memcmp(yg.data(), y_want.slice_rows(src, src + m).data(), yg.bytes()), 0) << "forward M=" << m;
    ASSERT_EQ(std::memcmp(dxg.data(), dx_want.slice_rows(src, src + m).data(), dxg.bytes()), 0) << "dX M=" << m;
  }
}

// The error of a dW (init + Σ over unmasked rows of dyᵀ·x, computed on the GPU) against an fp64 sum,
// in units of the fp32 summation bound: any order of n terms is within n·u·Σ|terms| (u = 2^-24);
// tensor cores truncate instead of rounding, so the unit is 2·n·u·Σ|terms|. Also prints the error
// in units of the contract's fp32 reduction tolerance (relative to |ref|, set on short reductions).
double dw_error_against_fp64(const HostTensor& got, const HostTensor& init, const HostTensor& dyh, const HostTensor& xh,
                             const HostTensor& mask, const char* what) {
  const int64_t M = dyh.shape()[0], N = dyh.shape()[1], K = xh.shape()[1];
  double worst_bound = 0, worst_contract = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double ref = init.get(n * K + k), mag = std::fabs(ref);
      int64_t terms = 1;
      for (int64_t m = 0; m < M; ++m)
        if (mask.get(m) != 0) {
          const double p = dyh.get(m * N + n) * xh.get(m * K + k);
          ref += p;
          mag += std::fabs(p);
          ++terms;
        }
      const double err = std::fabs(got.get(n * K + k) - ref);
      worst_bound = std::max(worst_bound, err / (2.0 * double(terms) * 0x1p-24 * mag));
      worst_contract = std::max(worst_contract, err / (2e-5 + 2e-5 * std::fabs(ref)));
    }
  std::printf("ACCURACY dW %s over %lld tokens: worst error / (2 n u sum|terms|) = %.3g; / contract fp32 "
              "reduction tolerance = %.3g\n", what, (long long)M, worst_bound, worst_contract);
  return worst_bound;
}

}  // namespace

class CudaLinear : public testing_cuda::CudaTest {};

TEST_F(CudaLinear, ForwardAndInputGradientAreInvariantAcrossTheMSweepBf16) { sweep_forward_and_dx(DType::bf16); }
TEST_F(CudaLinear, ForwardAndInputGradientAreInvariantAcrossTheMSweepFp16) { sweep_forward_and_dx(DType::f16); }
// N = 200, K = 136: the M sweep crosses the tile switches: 32-wide compact (forward; dX: its 136
// output columns) to 64-wide compact at M = 64, to 64-wide full at 128, 128 at 256, 192 / 256 at 512
// (192 while one round of two 192-wide column tiles beats one of a 256-wide tile), and the switch
// from the threads' own stores to TMA stores of the output at M = 128 (the M = 8192 reference is
// stored by TMA); wide outputs (>= 16384 columns) run 256- or 192-wide tiles.
TEST_F(CudaLinear, TileWidthsGiveIdenticalBits) {
  // The proof behind the one M-dependent choice: 32-, 48- (forward only), 64-, 128-, 192- and
  // 256-wide tiles (a 32-wide dX tile reads w in 64-byte-swizzled boxes), forced on the same
  // problems, give every element the same bits (forward and dX; bf16 and fp16; edge tiles; N = 1001:
  // fp32 rows whose pitch TMA cannot store, written by the threads). Tiles are compact (64 rows, one
  // consumer) at widths 32 and 48 always, at 64, 192 and 256 for M <= 64, and at 64 for M = 100 here;
  // the 128-wide ones are full, so M = 1, 33 and 100 compare the two. Narrow compact forward tiles
  // hold 4 / 2 k-boxes a stage where K allows (K = 1536, 4096, 12288; K = 1480: a last box partly
  // past K inside a wide stage; K = 1544: the one-box fallback).
  struct Shape { int64_t M, N, K; };
  for (DType dt : {DType::bf16, DType::f16})
    for (const Shape& sh : {Shape{1, 4096, 4096}, Shape{33, 2000, 1544}, Shape{77, 6144, 4096}, Shape{100, 1000, 1536}, Shape{512, 4096, 12288}, Shape{300, 1000, 1536},
                            Shape{1024, 200, 136}, Shape{300, 1001, 136}, Shape{5, 3000, 1480}}) {
      Rng r(uint64_t(sh.M + sh.N));
      const DeviceBuffer x(r.tensor(dt, {sh.M, sh.K}, -1, 1)), w(r.tensor(dt, {sh.N, sh.K}, -1, 1)),
          dy(r.tensor(dt, {sh.M, sh.N}, -1, 1));
      const int widths[6] = {64, 128, 192, 256, 32, 48};  // 48: forward only (dX runs 64 there)
      HostTensor y[6], dx[6];
      for (int i = 0; i < 6; ++i) {
        detail::gemm_tile_width_override() = widths[i];
        const DeviceBuffer yd(DType::f32, {sh.M, sh.N}), dxd(dt, {sh.M, sh.K});
        linear_forward(cuda_ctx(), {x.view(), w.view(), {}, yd.view()});
        linear_backward_input(cuda_ctx(), {dy.view(), w.view(), dxd.view()});
        y[i] = yd.host();
        dx[i] = dxd.host();
      }
      detail::gemm_tile_width_override() = 0;
      for (int i = 1; i < 6; ++i) {
        EXPECT_EQ(std::memcmp(y[0].data(), y[i].data(), y[0].bytes()), 0)
            << "forward M=" << sh.M << " N=" << sh.N << " width " << widths[i] << " vs 64";
        EXPECT_EQ(std::memcmp(dx[0].data(), dx[i].data(), dx[0].bytes()), 0)
            << "dX M=" << sh.M << " N=" << sh.N << " width " << widths[i] << " vs 64";
      }
    }
}

TEST_F(CudaLinear, GroupedPartsGiveEachPartsOwnBits) {
  // linear_group_forward runs Q / K / V (or gate / up) as one launch whose column tiles lie side by
  // side; every part must keep the bits of its own linear_forward: parts whose widths are not tile
  // multiples (a part's last tile is partial, never shared), a bias on one part, narrow (32 / 48 /
  // 64 / 128 / 192-wide tiles) and wide (>= 16384 columns: 256-wide) groups, compact and full tiles,
  // M across the tile switches and past one 2048-row raster group, bf16 and fp16, and fp32 outputs
  // (each part alone). Above M = 128 a launch stores by TMA only where every part's rows allow it:
  // a part of 1001 columns (a pitch TMA cannot store) beside TMA-storable ones, and a part's output
  // one element off 16-byte alignment, put the whole launch on the threads' stores.
  struct Group {
    int64_t K;
    std::vector<int64_t> N;
    int64_t max_m;
  };
  const std::vector<int64_t> all_ms = {1, 5, 33, 64, 65, 100, 128, 129, 256, 300, 777, 2100};
  for (DType dt : {DType::bf16, DType::f16})
    for (const Group& gr : {Group{4096, {4096, 1024, 1024}, 777}, Group{136, {200, 40, 72}, 2100},
                            Group{520, {9000, 8000}, 300}, Group{1544, {2000, 1000}, 777},
                            Group{136, {1001, 200, 64}, 2100}}) {
      Rng r(uint64_t(gr.K + gr.N[0]));
      const DeviceBuffer x(r.tensor(dt, {gr.max_m, gr.K}, -1, 1));
      std::vector<std::unique_ptr<DeviceBuffer>> w, b;
      for (int64_t n : gr.N) {
        w.push_back(std::make_unique<DeviceBuffer>(r.tensor(dt, {n, gr.K}, -1, 1)));
        b.push_back(std::make_unique<DeviceBuffer>(r.tensor(dt, {n}, -1, 1)));
      }
      for (int64_t m : all_ms) {
        if (m > gr.max_m) continue;
        for (DType out : {dt, DType::f32})
          for (bool shifted : {false, true}) {
            if (shifted && (out != dt || m < 129)) continue;  // the misaligned output: where TMA would store
            LinearGroupForwardArgs g;
            g.x = x.rows(0, m);
            std::vector<std::unique_ptr<DeviceBuffer>> y, want;
            std::unique_ptr<ShiftedBuffer> off;  // part 1's output, one element off alignment
            for (size_t i = 0; i < gr.N.size(); ++i) {
              y.push_back(std::make_unique<DeviceBuffer>(out, std::vector<int64_t>{m, gr.N[i]}));
              want.push_back(std::make_unique<DeviceBuffer>(out, std::vector<int64_t>{m, gr.N[i]}));
              const TensorView bias = i == 1 ? b[i]->view() : TensorView{};
              if (shifted && i == 1) off = std::make_unique<ShiftedBuffer>(HostTensor(out, {m, gr.N[i]}), 1);
              g.parts[g.count++] = {w[i]->view(), bias, off && i == 1 ? off->view() : y.back()->view()};
              linear_forward(cuda_ctx(), {g.x, w[i]->view(), bias, want.back()->view()});
            }
            linear_group_forward(cuda_ctx(), g);
            for (size_t i = 0; i < gr.N.size(); ++i)
              expect_same_bits(off && i == 1 ? off->host() : y[i]->host(), want[i]->host(),
                               "part " + std::to_string(i) + " of K=" + std::to_string(gr.K) + " N0=" +
                                   std::to_string(gr.N[0]) + " M=" + std::to_string(m) + " out " + dtype_name(out) +
                                   (shifted ? " (part 1 misaligned)" : ""));
          }
      }
    }
}

TEST_F(CudaLinear, SwiGluOutputGivesTheElementwiseOpsBitsFusedOrNot) {
  // linear_group_forward with a swiglu output: on a Hopper GPU, for decode-sized M, one launch whose
  // tiles pair gate's and up's columns and whose epilogue writes silu(gate)·up; elsewhere the parts,
  // then swiglu_forward. Both must give the bits of two linear_forward calls and swiglu_forward:
  // every tile width forced (32 / 48 / 64 / 192 / 256 and the launch's own choice), M across the
  // thin ring (16) and the compact tiles (64) and past them (the unfused path), N a multiple of every
  // half tile (1536) and not (1000; 1004 and 200: rows not 16-byte aligned, the stores' scalar tail),
  // K a multiple of the wide stages and not, settled weights, bf16 and fp16.
  struct Shape {
    int64_t N, K;
  };
  for (DType dt : {DType::bf16, DType::f16})
    for (const Shape sh : {Shape{1000, 4096}, Shape{12288 / 8, 520}, Shape{1004, 136}, Shape{200, 136}}) {
      Rng r(uint64_t(sh.N * 7 + sh.K));
      const int64_t max_m = 100;
      const DeviceBuffer x(r.tensor(dt, {max_m, sh.K}, -2, 2));
      const DeviceBuffer wg(r.tensor(dt, {sh.N, sh.K}, -1, 1)), wu(r.tensor(dt, {sh.N, sh.K}, -1, 1));
      for (int64_t m : {1, 2, 7, 8, 15, 16, 17, 33, 64, 65, 100}) {
        const DeviceBuffer gate(dt, {m, sh.N}), up(dt, {m, sh.N}), want(dt, {m, sh.N});
        linear_forward(cuda_ctx(), {x.rows(0, m), wg.view(), {}, gate.view()});
        linear_forward(cuda_ctx(), {x.rows(0, m), wu.view(), {}, up.view()});
        swiglu_forward(cuda_ctx(), {gate.view(), up.view(), want.view()});
        const HostTensor expected = want.host();
        for (int fused : {1, -1})
          for (int width : {0, 32, 48, 64, 192, 256})
            for (bool settled : {false, true}) {
              if (fused < 0 && width != 0) continue;
              const detail::ScopedOverride<int> f(detail::fused_swiglu_override(), fused);
              const detail::ScopedOverride<int> w(detail::gemm_tile_width_override(), width);
              const DeviceBuffer y(r.tensor(dt, {m, sh.N}, -9, 9));  // stale content: every element written
              const long long launches = detail::fused_swiglu_launches();
              LinearGroupForwardArgs g;
              g.x = x.rows(0, m);
              g.count = 2;
              g.parts[0].weight = wg.view();
              g.parts[1].weight = wu.view();
              g.swiglu = y.view();
              g.weights_settled = settled;
              linear_group_forward(cuda_ctx(), g);
              // The fused kernel ran where it takes the call (a Hopper GPU, M <= 64, a compact width:
              // every forced one but the parts' path), so the bits below are its own.
              const bool hopper = captured_graphs_available(Backend::cuda);  // the sm_90a path
              EXPECT_EQ(detail::fused_swiglu_launches() - launches, fused > 0 && hopper && m <= 64 ? 1 : 0)
                  << "M=" << m << " width " << width;
              expect_same_bits(y.host(), expected,
                               std::string(dtype_name(dt)) + " N=" + std::to_string(sh.N) + " K=" +
                                   std::to_string(sh.K) + " M=" + std::to_string(m) + (fused > 0 ? " fused" : " parts") +
                                   " width " + std::to_string(width) + (settled ? " settled" : ""));
            }
      }
    }
}

TEST_F(CudaLinear, SettledWeightsLoadBeforeTheWaitAndChangeNoBit) {
  // weight_settled: the ring's first weight loads go before the programmatic wait, while the kernel
  // before may still run; x, which that kernel writes, only after it. On a stream of its own (the
  // legacy stream never launches programmatically), each linear runs right after an RMSNorm that
  // rewrites its x from two inputs in turn (a stale x would show), programmatic launches forced on:
  // the bits of unsettled calls with them off — one part and grouped, M across the tile widths,
  // K = 4096 and a K shorter than the ring (K = 256 at M = 300: persistent CTAs run several tiles,
  // the later ones on the ordinary path), three rounds.
  DeviceStream stream(Backend::cuda);
  Context ctx = cuda_ctx();
  ctx.stream = stream.get();
  const DeviceStreamScope on(stream.get());
  for (const int64_t K : {int64_t(4096), int64_t(256)}) {
    Rng r(55 + uint64_t(K));
    const DeviceBuffer in_a(r.tensor(DType::bf16, {300, K}, -3, 3)), in_b(r.tensor(DType::bf16, {300, K}, -3, 3));
    const DeviceBuffer norm_w(r.tensor(DType::bf16, {K}, 0.5, 1.5));
    const DeviceBuffer w0(r.tensor(DType::bf16, {4096, K}, -1, 1)), w1(r.tensor(DType::bf16, {1024, K}, -1, 1));
    auto run = [&](int64_t m, bool settled, int pdl) {
      detail::programmatic_launch_override() = pdl;
      DeviceBuffer x(DType::bf16, {m, K}), rstd(DType::f32, {m});
      DeviceBuffer y(DType::bf16, {m, 4096}), g0(DType::bf16, {m, 4096}), g1(DType::bf16, {m, 1024});
      std::vector<HostTensor> out;
      for (int round = 0; round < 3; ++round)
        for (const DeviceBuffer* in : {&in_a, &in_b}) {
          RmsNormForwardArgs n;
          n.x = in->rows(0, m);
          n.weight = norm_w.view();
          n.y = x.view();
          n.rstd = rstd.view();
          n.eps = 1e-6;
          rmsnorm_forward(ctx, n);
          linear_forward(ctx, {x.view(), w0.view(), {}, y.view(), settled});
          rmsnorm_forward(ctx, n);  // the group's x is written just before it too
          LinearGroupForwardArgs g;
          g.x = x.view();
          g.parts[g.count++] = {w0.view(), {}, g0.view()};
          g.parts[g.count++] = {w1.view(), {}, g1.view()};
          g.weights_settled = settled;
          linear_group_forward(ctx, g);
          out.push_back(y.host());
          out.push_back(g0.host());
          out.push_back(g1.host());
        }
      detail::programmatic_launch_override() = 0;
      return out;
    };
    for (int64_t m : {1, 8, 64, 65, 300}) {
      const std::vector<HostTensor> want = run(m, false, -1), got = run(m, true, 1);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i)
        expect_same_bits(got[i], want[i], "K=" + std::to_string(K) + " M=" + std::to_string(m) + " output " + std::to_string(i));
    }
  }
}

TEST_F(CudaLinear, WideTilesAreInvariantAcrossM) {
  const std::vector<int64_t> ms = {1, 2, 7, 64, 127, 128, 129, 300, 1000, 2049};
  sweep_forward_and_dx(DType::bf16, 16400, 136, ms);  // forward: 256-wide tiles, an edge tile in N
  sweep_forward_and_dx(DType::bf16, 72, 16392, ms);   // dX: its output has 16392 columns
}

TEST_F(CudaLinear, WeightGradientChainsAcrossAnySplitOfTheRowsOnTheSequentialPath) {
  // N = 33: not a multiple of 8, so every architecture sums one token at a time.
  for (DType dt : {DType::bf16, DType::f16}) {
    const int64_t M = 1000, N = 33, K = 136;
    Rng r(5);
    const DeviceBuffer dy(r.tensor(dt, {M, N}, -1, 1)), x(r.tensor(dt, {M, K}, -1, 1));
    const HostTensor init = r.tensor(DType::f32, {N, K}, -1, 1);
    HostTensor mask(DType::u8, {M});
    for (int64_t i = 0; i < M; ++i) mask.set(i, i % 7 != 3);
    const DeviceBuffer maskd(mask);
    const DeviceBuffer one(init);
    linear_backward_weight(cuda_ctx(), {dy.view(), x.view(), maskd.view(), one.view(), {}, {}});
    const HostTensor want = one.host();
    for (std::vector<int64_t> cuts : {std::vector<int64_t>{1, 500}, {17, 18, 640, 999}, {250, 500, 750}}) {
      const DeviceBuffer acc(init);
      int64_t begin = 0;
      cuts.push_back(M);
      for (int64_t end : cuts) {
        linear_backward_weight(cuda_ctx(), {dy.rows(begin, end), x.rows(begin, end), maskd.view().rows(begin, end),
                                            acc.view(), {}, {}});
        begin = end;
      }
      const HostTensor got = acc.host();
      ASSERT_EQ(std::memcmp(got.data(), want.data(), got.bytes()), 0) << dtype_name(dt);
    }
  }
}

TEST_F(CudaLinear, WeightGradientOnTensorCoresKeepsItsBitsAcrossMicroBatchesAndPadding) {
  // Sequences as segments: one call over all of them == micro-batches split at sequence
  // boundaries == a padded layout with garbage in the padding; masked tokens inside sequences.
  const std::vector<int64_t> lens = {37, 100, 5, 64, 250, 17, 129, 398};
  const int64_t M = 1000, N = 72, K = 136, SLOT = 400;
  for (DType dt : {DType::bf16, DType::f16}) {
    Rng r(8);
    const HostTensor dyh = r.tensor(dt, {M, N}, -1, 1), xh = r.tensor(dt, {M, K}, -1, 1);
    const HostTensor init = r.tensor(DType::f32, {N, K}, -1, 1);
    HostTensor mask(DType::u8, {M});
    for (int64_t i = 0; i < M; ++i) mask.set(i, i % 11 != 4);
    auto segments_of = [&](size_t first, size_t last, bool padded) {
      HostTensor s(DType::i32, {int64_t(last - first), 2});
      int64_t row = 0;
      for (size_t i = first; i < last; ++i) {
        s.set(int64_t(2 * (i - first)), double(padded ? int64_t(i - first) * SLOT : row));
        s.set(int64_t(2 * (i - first) + 1), double(lens[i]));
        row += lens[i];
      }
      return s;
    };
    std::vector<int64_t> start = {0};
    for (auto l : lens) start.push_back(start.back() + l);
    const DeviceBuffer dy(dyh), x(xh), maskd(mask), one(init);
    const HostTensor all = segments_of(0, lens.size(), false);
    linear_backward_weight(cuda_ctx(), {dy.view(), x.view(), maskd.view(), one.view(), {}, all.view()});
    const HostTensor want = one.host();
    for (std::vector<size_t> cuts : {std::vector<size_t>{1, 2, 3, 4, 5, 6, 7}, {4}, {2, 5}}) {
      const DeviceBuffer acc(init);
      size_t first = 0;
      cuts.push_back(lens.size());
      for (size_t last : cuts) {
        const HostTensor segs = segments_of(first, last, false);
        const int64_t b = start[first], e = start[last];
        linear_backward_weight(cuda_ctx(), {dy.rows(b, e), x.rows(b, e), maskd.view().rows(b, e), acc.view(), {},
                                            segs.view()});
        first = last;
      }
      ASSERT_EQ(std::memcmp(acc.host().data(), want.data(), want.bytes()), 0) << dtype_name(dt) << " micro-batches";
    }
    // Padded: each sequence at the start of a 400-row slot, random rows after it.
    HostTensor dyp = r.tensor(dt, {int64_t(lens.size()) * SLOT, N}, -5, 5), xp = r.tensor(dt, {int64_t(lens.size()) * SLOT, K}, -5, 5);
    HostTensor maskp(DType::u8, {int64_t(lens.size()) * SLOT});
    for (size_t i = 0; i < lens.size(); ++i) {
      dyp.copy_rows_from(dyh, start[i], int64_t(i) * SLOT, lens[i]);
      xp.copy_rows_from(xh, start[i], int64_t(i) * SLOT, lens[i]);
      for (int64_t j = 0; j < lens[i]; ++j) maskp.set(int64_t(i) * SLOT + j, mask.get(start[i] + j));
    }
    const DeviceBuffer dypd(dyp), xpd(xp), maskpd(maskp), accp(init);
    const HostTensor segp = segments_of(0, lens.size(), true);
    linear_backward_weight(cuda_ctx(), {dypd.view(), xpd.view(), maskpd.view(), accp.view(), {}, segp.view()});
    ASSERT_EQ(std::memcmp(accp.host().data(), want.data(), want.bytes()), 0) << dtype_name(dt) << " padded";
    const double worst = dw_error_against_fp64(want, init, dyh, xh, mask, dtype_name(dt));
    EXPECT_LE(worst, 1.0);
  }
}

TEST_F(CudaLinear, WeightGradientSplitsLongChunkListsAndIgnoresNaNPadding) {
  // 1500 sequences of 1-3 tokens: more chunks than one launch carries (640), so the call chains
  // launches through the accumulator; it must equal micro-batches cut elsewhere, be accurate (no
  // chunk dropped or repeated at a launch boundary), and a padded layout whose padding rows hold NaN
  // in both operands must give the same bits (the rows a k16 step reads past a sequence are zeroed).
  const int64_t S = 1500, N = 64, K = 128, SLOT = 4;
  std::vector<int64_t> lens, start = {0};
  for (int64_t i = 0; i < S; ++i) {
    lens.push_back(1 + i % 3);
    start.push_back(start.back() + lens.back());
  }
  const int64_t M = start.back();
  for (DType dt : {DType::bf16, DType::f16}) {
    Rng r(21);
    const HostTensor dyh = r.tensor(dt, {M, N}, -1, 1), xh = r.tensor(dt, {M, K}, -1, 1);
    const HostTensor init = r.tensor(DType::f32, {N, K}, -1, 1);
    HostTensor mask(DType::u8, {M});
    for (int64_t i = 0; i < M; ++i) mask.set(i, 1);
    auto segments = [&](int64_t first, int64_t last, int64_t slot) {
      HostTensor s(DType::i32, {last - first, 2});
      for (int64_t i = first; i < last; ++i) {
        s.set(2 * (i - first), double(slot ? (i - first) * slot : start[i] - start[first]));
        s.set(2 * (i - first) + 1, double(lens[size_t(i)]));
      }
      return s;
    };
    const DeviceBuffer dy(dyh), x(xh), one(init);
    const HostTensor all = segments(0, S, 0);
    linear_backward_weight(cuda_ctx(), {dy.view(), x.view(), {}, one.view(), {}, all.view()});
    const HostTensor want = one.host();
    const DeviceBuffer acc(init);
    for (auto [first, last] : {std::pair<int64_t, int64_t>{0, 700}, {700, 1100}, {1100, S}}) {
      const HostTensor segs = segments(first, last, 0);
      linear_backward_weight(cuda_ctx(), {dy.rows(start[size_t(first)], start[size_t(last)]),
                                          x.rows(start[size_t(first)], start[size_t(last)]), {}, acc.view(), {},
                                          segs.view()});
    }
    ASSERT_EQ(std::memcmp(acc.host().data(), want.data(), want.bytes()), 0) << dtype_name(dt) << " micro-batches";
    EXPECT_LE(dw_error_against_fp64(want, init, dyh, xh, mask, dtype_name(dt)), 1.0);
    HostTensor dyp(dt, {S * SLOT, N}), xp(dt, {S * SLOT, K});
    for (int64_t i = 0; i < S * SLOT * N; ++i) dyp.set(i, std::nan(""));
    for (int64_t i = 0; i < S * SLOT * K; ++i) xp.set(i, std::nan(""));
    for (int64_t i = 0; i < S; ++i) {
      dyp.copy_rows_from(dyh, start[size_t(i)], i * SLOT, lens[size_t(i)]);
      xp.copy_rows_from(xh, start[size_t(i)], i * SLOT, lens[size_t(i)]);
    }
    const DeviceBuffer dypd(dyp), xpd(xp), accp(init);
    const HostTensor segp = segments(0, S, SLOT);
    linear_backward_weight(cuda_ctx(), {dypd.view(), xpd.view(), {}, accp.view(), {}, segp.view()});
    ASSERT_EQ(std::memcmp(accp.host().data(), want.data(), want.bytes()), 0) << dtype_name(dt) << " NaN padding";
  }
}

TEST_F(CudaLinear, HundredRepeatsAreIdentical) {
  const int64_t M = 333, N = 520, K = 264;
  Rng r(3);
  const DeviceBuffer x(r.tensor(DType::bf16, {M, K}, -1, 1)), w(r.tensor(DType::bf16, {N, K}, -1, 1));
  const DeviceBuffer y(DType::bf16, {M, N});
  linear_forward(cuda_ctx(), {x.view(), w.view(), {}, y.view()});
  const HostTensor first = y.host();
  for (int i = 0; i < 100; ++i) {
    linear_forward(cuda_ctx(), {x.view(), w.view(), {}, y.view()});
    const HostTensor again = y.host();
    ASSERT_EQ(std::memcmp(first.data(), again.data(), first.bytes()), 0) << "repeat " << i;
  }
}

// Prints an FNV-1a hash of forward, dX and dW outputs for fixed inputs, so runs on different cards
// of one architecture (H100, H200) can be compared bit for bit (bench/gpu_check.sh greps "HASH").
TEST_F(CudaLinear, PrintsOutputHashesForCrossCardComparison) {
  auto fnv = [](const HostTensor& t) {
    uint64_t h = 1469598103934665603ull;
    const auto* p = static_cast<const uint8_t*>(t.data());
    for (size_t i = 0; i < t.bytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  };
  const int64_t M = 777, N = 1024, K = 1536;
  Rng r(99);
  const DeviceBuffer x(r.tensor(DType::bf16, {M, K}, -1, 1)), w(r.tensor(DType::bf16, {N, K}, -1, 1)),
      dy(r.tensor(DType::bf16, {M, N}, -1, 1));
  const DeviceBuffer y(DType::bf16, {M, N}), dx(DType::bf16, {M, K}), dw(DType::f32, {N, K});
  linear_forward(cuda_ctx(), {x.view(), w.view(), {}, y.view()});
  linear_backward_input(cuda_ctx(), {dy.view(), w.view(), dx.view()});
  linear_backward_weight(cuda_ctx(), {dy.view(), x.view(), {}, dw.view(), {}, {}});
  std::printf("HASH forward=%016llx dX=%016llx dW=%016llx\n", (unsigned long long)fnv(y.host()),
              (unsigned long long)fnv(dx.host()), (unsigned long long)fnv(dw.host()));
}

TEST_F(CudaLinear, BadInputIsAClearErrorOrACorrectSlowerPath) {
  // K = 67 (not a multiple of 8): the generic path, still accurate against the CPU reference.
  const int64_t M = 9, N = 40, K = 67;
  Rng r(12);
  const HostTensor xh = r.tensor(DType::bf16, {M, K}, -1, 1), wh = r.tensor(DType::bf16, {N, K}, -1, 1);
  const DeviceBuffer x(xh), w(wh), y(DType::f32, {M, N});
  linear_forward(cuda_ctx(), {x.view(), w.view(), {}, y.view()});
  HostTensor yc(DType::f32, {M, N});
  linear_forward(Context{}, {xh.view(), wh.view(), {}, yc.view()});
  const HostTensor yg = y.host();
  for (int64_t i = 0; i < yg.numel(); ++i) EXPECT_NEAR(yg.get(i), yc.get(i), 1e-4 + 1e-4 * std::fabs(yc.get(i)));
  // K = 64 from a base 2 bytes off 16-byte alignment: the Hopper path refuses it by name.
  if (cuda_backend_built()) {
    const DeviceBuffer big(r.tensor(DType::bf16, {4 * 64 + 8}, -1, 1)), w2(r.tensor(DType::bf16, {16, 64}, -1, 1)),
        y2(DType::f32, {4, 16});
    TensorView xv = TensorView::of(static_cast<char*>(big.view().data) + 2, DType::bf16, {4, 64}, Device::cuda);
    try {
      linear_forward(cuda_ctx(), {xv, w2.view(), {}, y2.view()});
      // Another architecture takes the generic path, which accepts any element alignment.
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
    }
  }
  // The fp32 dW accumulator 4 bytes off 16-byte alignment: refused by name on the Hopper path (its
  // 8-byte pair accesses), accumulated one token at a time elsewhere.
  if (cuda_backend_built()) {
    const DeviceBuffer dy(r.tensor(DType::bf16, {4, 16}, -1, 1)), x4(r.tensor(DType::bf16, {4, 64}, -1, 1)),
        acc(r.tensor(DType::f32, {16 * 64 + 4}, -1, 1));
    TensorView dwv = TensorView::of(static_cast<char*>(acc.view().data) + 4, DType::f32, {16, 64}, Device::cuda);
    try {
      linear_backward_weight(cuda_ctx(), {dy.view(), x4.view(), {}, dwv, {}, {}});
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("dweight"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
    }
  }
  // fp32 inputs are unsupported on CUDA by design, with a message naming the dtype.
  const DeviceBuffer xf(r.tensor(DType::f32, {2, 8}, -1, 1)), wf(r.tensor(DType::f32, {3, 8}, -1, 1)), yf(DType::f32, {2, 3});
  EXPECT_THROW(linear_forward(cuda_ctx(), {xf.view(), wf.view(), {}, yf.view()}), Unsupported);
}

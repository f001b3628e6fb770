// CUDA elementwise ops (runs where a GPU is visible; skipped elsewhere): SwiGLU forward / backward
// and the residual add, whose vector and element-by-element paths must agree bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "samebits/ops.hpp"
#include "tests/cuda/cuda_test_util.hpp"

class CudaElementwise : public CudaTest {};

// Elementwise: the vector path and the element-by-element path (unaligned buffers, a tail) give the
// same bits; SwiGLU forward / backward against fp64.
TEST_F(CudaElementwise, VectorAndScalarPathsAgreeAndAreAccurate) {
  Rng r(53);
  const int64_t n = 1003;  // a 3-element tail
  const HostTensor g = r.tensor(DType::bf16, {1, n}, -6, 6), u = r.tensor(DType::bf16, {1, n}, -2, 2),
                   dy = r.tensor(DType::bf16, {1, n}, -1, 1);
  auto swiglu = [&](int64_t shift) {
    const ShiftedBuffer dg(g, shift), du(u, shift), ddy(dy, shift), y(HostTensor(DType::f32, {1, n}), shift),
        dgate(HostTensor(DType::f32, {1, n}), shift), dup(HostTensor(DType::f32, {1, n}), shift);
    swiglu_forward(cuda_ctx(), SwiGluForwardArgs{dg.view(), du.view(), y.view()});
    swiglu_backward(cuda_ctx(), SwiGluBackwardArgs{ddy.view(), dg.view(), du.view(), dgate.view(), dup.view()});
    return std::vector<HostTensor>{y.host(), dgate.host(), dup.host()};
  };
  const auto aligned = swiglu(0), unaligned = swiglu(1);
  for (int k = 0; k < 3; ++k) expect_same_bits(unaligned[k], aligned[k], "swiglu output " + std::to_string(k));
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double gi = g.get(i), ui = u.get(i), di = dy.get(i), sig = 1.0 / (1.0 + std::exp(-gi));
    const double want[3] = {gi * sig * ui, di * ui * sig * (1 + gi * (1 - sig)), di * gi * sig};
    for (int k = 0; k < 3; ++k)
      worst = std::max(worst, std::fabs(aligned[k].get(i) - want[k]) / (1e-6 * std::fabs(want[k]) + 1e-7));
  }
  std::printf("ACCURACY swiglu fp32: worst error / tolerance %.3g\n", worst);
  EXPECT_LE(worst, 1.0);
  const ShiftedBuffer a(g, 1), b(u, 1), y(HostTensor(DType::bf16, {1, n}), 1);
  residual_add_forward(cuda_ctx(), ResidualAddArgs{a.view(), b.view(), y.view()});
  const HostTensor got = y.host();
  for (int64_t i = 0; i < n; ++i) {
    HostTensor one(DType::bf16, {1});
    one.set(0, float(float(g.get(i)) + float(u.get(i))));
    ASSERT_EQ(std::memcmp(static_cast<const char*>(got.data()) + 2 * i, one.data(), 2), 0) << "residual add " << i;
  }
}

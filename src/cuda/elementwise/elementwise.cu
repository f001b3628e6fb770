// CUDA elementwise ops: SwiGLU (silu(gate)·up) and the residual add, forward and backward.
//
// Why this shape. No element depends on another, so invariance rests on two things this file
// guarantees: an element's arithmetic is one fixed expression in fp32 with every rounding explicit
// (__fmul_rn / __fadd_rn / __fdiv_rn are never contracted into FMAs, so the 16-byte vector path and
// the element-by-element tail, compiled separately, cannot differ), and it reads only same-index
// inputs. The kernels are bandwidth-bound: each thread moves one 8-element vector (vec8.cuh) of
// every tensor, in one pass over the flat tensor; the launch shape changes who computes an element,
// never how.
#include <algorithm>

#include "cuda/common/activation.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/vec8.cuh"
#include "ops/registry.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"

namespace samebits::cuda {
namespace {

constexpr int THREADS = 256;

// An op fetches a vector of every input (fetch: loads only) before it widens them, computes and
// stores (finish), so all of a thread's loads are in flight at once.
struct SwiGluFwd {
  In8 gate, up;
  Out8 y;
  struct Regs {
    Raw8 g, u;
  };
  __device__ void fetch(int64_t i, int n, Regs& r) const { r.g = fetch8(gate, i, n), r.u = fetch8(up, i, n); }
  __device__ void finish(int64_t i, int n, const Regs& r) const {
    float g[8], u[8], out[8];
    unpack8(gate.dt, r.g, g);
    unpack8(up.dt, r.u, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = swiglu_value(g[e], u[e]);
    store8(y, i, n, out);
  }
};

// dup = dy·silu(g); dgate = dy·up·σ(g)·(1 + g·(1 − σ(g))).
struct SwiGluBwd {
  In8 dy, gate, up;
  Out8 dgate, dup;
  struct Regs {
    Raw8 d, g, u;
  };
  __device__ void fetch(int64_t i, int n, Regs& r) const {
    r.d = fetch8(dy, i, n), r.g = fetch8(gate, i, n), r.u = fetch8(up, i, n);
  }
  __device__ void finish(int64_t i, int n, const Regs& r) const {
    float d[8], g[8], u[8], dg[8], du[8];
    unpack8(dy.dt, r.d, d);
    unpack8(gate.dt, r.g, g);
    unpack8(up.dt, r.u, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float sig = sigmoid(g[e]);
      du[e] = __fmul_rn(d[e], __fmul_rn(g[e], sig));
      const float slope = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(g[e], __fsub_rn(1.0f, sig))));
      dg[e] = __fmul_rn(__fmul_rn(d[e], u[e]), slope);
    }
    store8(dgate, i, n, dg);
    store8(dup, i, n, du);
  }
};

struct AddFwd {
  In8 a, b;
  Out8 y;
  struct Regs {
    Raw8 x, z;
  };
  __device__ void fetch(int64_t i, int n, Regs& r) const { r.x = fetch8(a, i, n), r.z = fetch8(b, i, n); }
  __device__ void finish(int64_t i, int n, const Regs& r) const {
    float x[8], z[8];
    unpack8(a.dt, r.x, x);
    unpack8(b.dt, r.z, z);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = __fadd_rn(x[e], z[e]);
    store8(y, i, n, x);
  }
};

struct AddBwd {  // da = db = dy, each in its own dtype (either may be absent)
  In8 dy;
  Out8 da, db;
  struct Regs {
    Raw8 d;
  };
  __device__ void fetch(int64_t i, int n, Regs& r) const { r.d = fetch8(dy, i, n); }
  __device__ void finish(int64_t i, int n, const Regs& r) const {
    float d[8];
    unpack8(dy.dt, r.d, d);
    if (da.p) store8(da, i, n, d);
    if (db.p) store8(db, i, n, d);
  }
};

// One pass, no grid-stride loop: thread t of CTA c takes vector c · THREADS + t (a warp accesses
// 512 contiguous bytes of each tensor). Measured on an H100 (bench/bench_norm.py): two or four
// vectors a thread were no faster (SiLU·mul 200.0 / 229.1 µs against 200.3; add 69.6 / 70.1
// against 69.3), so one.
template <class Op>
__global__ void __launch_bounds__(THREADS) elementwise(Op op, int64_t numel) {
  pdl_wait();  // launched after the previous kernel (cuda/common/pdl.cuh): its output is ready from here
  pdl_launch_dependents();
  const int64_t v = int64_t(blockIdx.x) * THREADS + threadIdx.x;
  if (v >= (numel + 7) / 8) return;
  const int n = int(std::min<int64_t>(8, numel - v * 8));
  typename Op::Regs r;
  op.fetch(v * 8, n, r);
  op.finish(v * 8, n, r);
}

template <class Op>
void launch(const Op& op, int64_t numel, const Context& ctx, const char* name) {
  if (numel == 0) return;
  const int64_t grid = ((numel + 7) / 8 + THREADS - 1) / THREADS;
  if (grid > 0x7fffffff) throw Unsupported(name, "x", "a tensor of more than 2^31 · 2048 elements");
  launch_after_previous(elementwise<Op>, dim3(unsigned(grid)), dim3(THREADS), 0, stream_of(ctx.stream), name, op,
                        numel);
  check(cudaGetLastError(), name, "kernel launch");
}

void swiglu_forward(const Context& ctx, const SwiGluForwardArgs& a) {
  const int64_t n = a.gate.numel();
  launch(SwiGluFwd{in8(a.gate, n), in8(a.up, n), out8(a.y, n)}, n, ctx, "swiglu_forward");
}

void swiglu_backward(const Context& ctx, const SwiGluBackwardArgs& a) {
  const int64_t n = a.gate.numel();
  launch(SwiGluBwd{in8(a.dy, n), in8(a.gate, n), in8(a.up, n), out8(a.dgate, n), out8(a.dup, n)}, n, ctx,
         "swiglu_backward");
}

void residual_add_forward(const Context& ctx, const ResidualAddArgs& a) {
  const int64_t n = a.a.numel();
  launch(AddFwd{in8(a.a, n), in8(a.b, n), out8(a.y, n)}, n, ctx, "residual_add_forward");
}

void residual_add_backward(const Context& ctx, const ResidualAddBackwardArgs& a) {
  const int64_t n = a.dy.numel();
  launch(AddBwd{in8(a.dy, n), out8(a.da, n), out8(a.db, n)}, n, ctx,
         "residual_add_backward");
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(swiglu_forward, Backend::cuda, SwiGluForwardArgs, swiglu_forward);
SAMEBITS_REGISTER_KERNEL(swiglu_backward, Backend::cuda, SwiGluBackwardArgs, swiglu_backward);
SAMEBITS_REGISTER_KERNEL(residual_add_forward, Backend::cuda, ResidualAddArgs, residual_add_forward);
SAMEBITS_REGISTER_KERNEL(residual_add_backward, Backend::cuda, ResidualAddBackwardArgs, residual_add_backward);

}  // namespace samebits::cuda

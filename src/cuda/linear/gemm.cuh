// The CUDA GEMM family: operands by strides, and the kernels' entry points.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "samebits/dtype.hpp"

namespace samebits::cuda {

// C[m][n] = Σ_k A(m, k)·B(n, k) (+ bias[n]) with A(m, k) = a[m*sam + k*sak], B(n, k) = b[n*sbn + k*sbk],
// C stored row-major with leading dimension ldo in out_dtype.
template <class T>
struct GemmOperands {
  const T* a;
  const T* b;
  const T* bias;  // null: none
  void* out;
  DType out_dtype;
  int64_t M, N, K, sam, sak, sbn, sbk, ldo;
  bool a_k_contiguous, b_k_contiguous;
};

template <class T>
void gemm_generic(const GemmOperands<T>& p, cudaStream_t stream);

// The Hopper path (gemm_sm90.cu): y[M,N] = x[M,K]·w[N,K]ᵀ (+ bias), K a multiple of 8.
bool sm90_path_available();
template <class T>
// weights_settled: w may be read before the previous kernel on the stream ends (LinearForwardArgs).
void gemm_sm90_forward(const T* x, const T* w, const T* bias, void* out, DType out_dtype, int64_t M, int64_t N,
                       int64_t K, cudaStream_t stream, bool weights_settled = false);
// y_g[M,N_g] = x·w_gᵀ (+ bias_g) for g < count <= kMaxLinearProducts, outputs in T, as one launch
// whose tiles cover every product's columns; each y_g bitwise what gemm_sm90_forward gives alone.
constexpr int kMaxLinearProducts = 3;
template <class T>
void gemm_sm90_forward_products(const T* x, const T* const* w, const T* const* bias, void* const* out,
                                const int64_t* N, int count, int64_t M, int64_t K, cudaStream_t stream,
                                bool weights_settled = false);
// silu(x·w_gateᵀ)·(x·w_upᵀ) into y [M, N], each product rounded to T before the SwiGLU: bitwise the
// two forwards then swiglu_forward. One launch (tiles pairing gate's and up's columns); false where
// it does not take the call (M > 64, a tile width it has no instance of): the caller runs the parts.
template <class T>
bool gemm_sm90_forward_swiglu(const T* x, const T* w_gate, const T* w_up, T* y, int64_t M, int64_t N, int64_t K,
                              cudaStream_t stream, bool weights_settled);
// dx[M,K] = dy[M,N]·w[N,K] on the Hopper path (N and K multiples of 8).
template <class T>
void gemm_sm90_input_grad(const T* dy, const T* w, void* dx, DType out_dtype, int64_t M, int64_t N, int64_t K,
                          cudaStream_t stream);

// dx = acc_in + dy·w with the accumulators starting from the fp32 acc_in[M,K] (which may be dx itself
// when out_dtype is fp32): a reduction over N cut into consecutive pieces, each a multiple of 64
// long, and chained through fp32 gives the bits of one uncut call (the fused LM head's backward).
template <class T>
void gemm_sm90_input_grad_continue(const T* dy, const T* w, const float* acc_in, void* dx, DType out_dtype, int64_t M,
                                   int64_t N, int64_t K, cudaStream_t stream);

// The Hopper weight gradient (gemm_sm90_wgrad.cu): token groups anchored to segments; N, K % 8 == 0.
template <class T>
void gemm_sm90_weight_grad(const T* dy, const T* x, const uint8_t* mask, const int32_t* segments, int64_t n_segments,
                           float* dw, int64_t M, int64_t N, int64_t K, cudaStream_t stream);

// dweight[n][k] += Σ_m dy[m][n]·x[m][k] over unmasked m, strictly in ascending m (fp32 FMA per
// element), so any split of the rows into micro-batches gives the same bits; dbias likewise.
template <class T>
void gemm_weight_grad_sequential(const T* dy, const T* x, const uint8_t* row_mask, float* dweight, float* dbias,
                                 int64_t M, int64_t N, int64_t K, cudaStream_t stream);

}  // namespace samebits::cuda

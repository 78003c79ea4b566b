// y [R, N] = x [R, K] · w [N, K]ᵀ (+ bias) over a few rows R (2 to engine.layers.small_linear.SMALL_ROWS), the
// operator specd::small_rows_linear; engine/layers/small_linear.py builds and loads it.
//
// At a few rows a linear layer should cost a read of its weight plus each row's multiply-adds at the CPU's
// rate. Inductor's own loop for the product (one accumulator per row and output) waits on every fused
// multiply-add's latency. Here the adds of independent accumulators overlap, and past 8 rows a tile of 3 input
// rows x 4 weight rows uses each vector it loads three or four times: each row past the first cost the embedded
// target's compiled forward 0.51 ms on a 2-core AVX2 host instead of 0.94 (benchmarks/small_rows_linear.py). The
// weight's [N, K] layout is read as it is: no packed copy.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>

namespace {

#if defined(__AVX512F__)
constexpr int kBytes = 64;
#else
constexpr int kBytes = 32;
#endif
constexpr int kLanes = kBytes / 4;
typedef float vf __attribute__((vector_size(kBytes)));

inline vf loadu(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One tile: rows [r0, r0 + NR) of x against weight rows [j0, j0 + NJ), the reduction in U interleaved vectors.
// NR, NJ and U are constants, so the loops unroll into registers.
template <int NR, int NJ, int U>
inline void tile(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t r0,
                 int64_t j0) {
  vf acc[U][NR][NJ];
  for (int u = 0; u < U; u++)
    for (int r = 0; r < NR; r++)
      for (int c = 0; c < NJ; c++) acc[u][r][c] = vf{};
  int64_t i = 0;
  for (; i + U * kLanes <= K; i += U * kLanes)
    for (int u = 0; u < U; u++) {
      vf wv[NJ];
      for (int c = 0; c < NJ; c++) wv[c] = loadu(w + (j0 + c) * K + i + u * kLanes);
      for (int r = 0; r < NR; r++) {
        const vf xv = loadu(x + (r0 + r) * K + i + u * kLanes);
        for (int c = 0; c < NJ; c++) acc[u][r][c] += xv * wv[c];
      }
    }
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < NJ; c++) {
      float s = 0.0f;
      for (int u = 0; u < U; u++)
        for (int l = 0; l < kLanes; l++) s += acc[u][r][c][l];
      for (int64_t t = i; t < K; t++) s += x[(r0 + r) * K + t] * w[(j0 + c) * K + t];
      y[(r0 + r) * N + j0 + c] = bias ? s + bias[j0 + c] : s;
    }
}

// Weight rows [j0, j0 + NJ) against every row of x, three at a time.
template <int NJ>
inline void rows(const float* x, const float* w, const float* bias, float* y, int64_t R, int64_t K, int64_t N,
                 int64_t j0) {
  int64_t r0 = 0;
  for (; r0 + 3 <= R; r0 += 3) tile<3, NJ, 1>(x, w, bias, y, K, N, r0, j0);
  if (R - r0 == 2) tile<2, NJ, 1>(x, w, bias, y, K, N, r0, j0);
  if (R - r0 == 1) tile<1, NJ, 1>(x, w, bias, y, K, N, r0, j0);
}

at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "specd::small_rows_linear: x ", x.sizes(), " against a weight of ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu(),
              "specd::small_rows_linear takes float32 CPU tensors");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t R = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "specd::small_rows_linear: bias ", b.sizes());
  }
  at::Tensor y = at::empty({R, N}, xc.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Split over the weight's rows: each thread streams its own part of the weight once. Up to 8 rows, a weight
  // row at a time against each input row (two accumulators hide the adds' latency; its sequential reads keep the
  // stream at memory speed); past that, tiles of 3 input rows x 4 weight rows reuse each load more.
  if (R <= 8) {
    at::parallel_for(0, N, 48, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; j++)
        for (int64_t r = 0; r < R; r++) tile<1, 1, 2>(xp, wp, bp, yp, K, N, r, j);
    });
  } else {
    at::parallel_for(0, (N + 3) / 4, 12, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; blk++) {
        const int64_t j0 = 4 * blk;
        if (N - j0 >= 4) {
          rows<4>(xp, wp, bp, yp, R, K, N, j0);
        } else {
          for (int64_t j = j0; j < N; j++) rows<1>(xp, wp, bp, yp, R, K, N, j);
        }
      }
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) { m.def("small_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(specd, CPU, m) { m.impl("small_rows_linear", &small_rows_linear); }

// y [R, n] = x [R, K] · wᵀ (+ bias) over a few rows R (2 to engine.layers.small_linear.SMALL_ROWS), the operator
// specd::small_rows_linear; engine/layers/small_linear.py packs the weight and builds and loads this.
//
// At a few rows a linear layer should cost a read of its weight plus each row's multiply-adds at the CPU's rate.
// The weight comes packed in panels [P, K, 16]: panel p holds weight rows 16p..16p+15 transposed (zeros past n),
// so one step along K reads 16 outputs' weights as whole vectors. A tile of up to kRows input rows keeps 16
// outputs per row in accumulators and adds x[r, k] (a broadcast load) times the panel's row k: no horizontal
// sums, each weight vector loaded once per tile and used by every row, independent accumulators to hide the
// multiply-adds' latency, and each thread streams its own panels once, front to back. Read from the weight's
// own [N, K] layout, a weight row at a time against each input row, the embedded target's compiled forward paid
// ~0.5 ms for each row past the first on a 2-core AVX2 host (benchmarks/small_rows_linear.py has the figures now).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

#if defined(__AVX512F__)
constexpr int kBytes = 64;
constexpr int kRows = 12;  // 32 vector registers: 12 accumulators
#else
constexpr int kBytes = 32;
constexpr int kRows = 6;  // 16 vector registers: 12 accumulators, 2 weight vectors, 1 broadcast
#endif
constexpr int kLanes = kBytes / 4;
constexpr int kWidth = 16;  // outputs a panel holds: small_linear.PANEL
constexpr int kVectors = kWidth / kLanes;
typedef float vf __attribute__((vector_size(kBytes)));

inline vf loadu(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Rows [r0, r0 + NR) of x against one panel: outputs [col, col + kWidth) of y, of which the first ``valid`` exist.
template <int NR>
inline void tile(const float* x, const float* panel, const float* bias, float* y, int64_t K, int64_t n, int64_t r0,
                 int64_t col, int64_t valid) {
  vf acc[NR][kVectors];
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < kVectors; c++) acc[r][c] = vf{};
  const float* rows[NR];
  for (int r = 0; r < NR; r++) rows[r] = x + (r0 + r) * K;
  for (int64_t k = 0; k < K; k++) {
    vf w[kVectors];
    for (int c = 0; c < kVectors; c++) w[c] = loadu(panel + k * kWidth + c * kLanes);
    for (int r = 0; r < NR; r++) {
      const float xv = rows[r][k];  // scalar times vector: one broadcast load
      for (int c = 0; c < kVectors; c++) acc[r][c] += xv * w[c];
    }
  }
  for (int r = 0; r < NR; r++) {
    float out[kWidth];
    std::memcpy(out, acc[r], sizeof out);
    float* dst = y + (r0 + r) * n + col;
    for (int64_t c = 0; c < valid; c++) dst[c] = bias ? out[c] + bias[col + c] : out[c];
  }
}

// The last ``left`` (< NR) rows in one tile of their own size.
template <int NR>
inline void tail(int64_t left, const float* x, const float* panel, const float* bias, float* y, int64_t K, int64_t n,
                 int64_t r0, int64_t col, int64_t valid) {
  if constexpr (NR > 0) {
    if (left == NR) {
      tile<NR>(x, panel, bias, y, K, n, r0, col, valid);
    } else {
      tail<NR - 1>(left, x, panel, bias, y, K, n, r0, col, valid);
    }
  }
}

at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                             int64_t n) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kWidth && x.size(1) == panels.size(1),
              "specd::small_rows_linear: x ", x.sizes(), " against weight panels of ", panels.sizes());
  TORCH_CHECK(n > (panels.size(0) - 1) * kWidth && n <= panels.size(0) * kWidth, "specd::small_rows_linear: ", n,
              " outputs from weight panels of ", panels.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  panels.device().is_cpu(),
              "specd::small_rows_linear takes float32 CPU tensors");
  const at::Tensor xc = x.contiguous(), pc = panels.contiguous();
  const int64_t R = xc.size(0), K = xc.size(1), P = pc.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "specd::small_rows_linear: bias ", b.sizes());
  }
  at::Tensor y = at::empty({R, n}, xc.options());
  const float *xp = xc.data_ptr<float>(), *pp = pc.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const float* panel = pp + p * K * kWidth;
      const int64_t col = p * kWidth, valid = std::min<int64_t>(kWidth, n - col);
      int64_t r0 = 0;
      for (; r0 + kRows <= R; r0 += kRows) tile<kRows>(xp, panel, bp, yp, K, n, r0, col, valid);
      tail<kRows - 1>(R - r0, xp, panel, bp, yp, K, n, r0, col, valid);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) {
  m.def("small_rows_linear(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(specd, CPU, m) { m.impl("small_rows_linear", &small_rows_linear); }

// Attention of a batch's short queries over their paged K/V, read in place: the operator specd::paged_attention,
// which engine/layers/cpu_attention.py builds and loads. Each key row is read once for all the query rows that
// share it (Q positions x the query heads of a KV group), so the cost is one read of the cache's rows plus
// arithmetic, where a gather into a padded copy reads them, writes the copy and reads it again. Each query row sees
// keys [0, position + 1): causal, and the padding past a sequence's own context is never read.
//
// Keys are cut into chunks of CHUNK positions counted from a sequence's first key. A task is one chunk of one
// sequence (all its KV heads, so a key's row is read as one contiguous stretch), and writes, per query row, the
// chunk's softmax partials: its largest score, the sum of its exponentials and their weighted sum of values. A
// second pass merges a row's chunks in order. Two threads thus share one sequence's keys at batch 1, where a task
// per sequence left one idle and a task per head read 256-byte slices of 1.5 kB rows (2-4x slower past 128 keys).
// The chunks depend only on the row's own positions, never on the batch or the thread count, so a row's result
// is the same bit for bit whatever batch it is in.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t CHUNK = 32;

struct Layout {
  int64_t G, Q, H, Hkv, C, D;
  float scale;
};

// One task: keys [c0, c1) of sequence g for KV heads [hk0, hk0 + per_task), into the partials of its slab
// (rows h * Q + i, h the query head). DC is the head size where it is one of the common ones, a constant the loops
// vectorise for without remainders; 0 takes it from the layout.
template <int64_t DC>
void chunk(const float* q, const float* k, const float* v, const int64_t* slots, const int64_t* qpos, float* mx_out,
           float* sum_out, float* acc_out, const Layout& s, int64_t g, int64_t c0, int64_t hk0, int64_t per_task,
           std::vector<float>& scores, std::vector<int64_t>& last, std::vector<const float*>& qp) {
  const int64_t D = DC > 0 ? DC : s.D;
  const int64_t group = s.H / s.Hkv, rows_per_head = group * s.Q, M = per_task * rows_per_head;
  scores.resize(M * CHUNK);
  last.resize(M);
  qp.resize(M);
  int64_t c1 = c0;  // keys any row of this task sees: [c0, c1)
  for (int64_t m = 0; m < M; m++) {
    const int64_t h = hk0 * group + m / s.Q, i = m % s.Q;
    last[m] = std::min({qpos[g * s.Q + i] + 1, s.C, c0 + CHUNK});
    c1 = std::max(c1, last[m]);
    qp[m] = q + ((g * s.Q + i) * s.H + h) * D;
  }
  const int64_t* sl = slots + g * s.C;
  for (int64_t c = c0; c < c1; c++) {
    const float* key = k + (sl[c] * s.Hkv + hk0) * D;
    for (int64_t m = 0; m < M; m++) {
      if (c >= last[m]) continue;  // a padding row (or an earlier query) sees no further
      const float* __restrict kr = key + (m / rows_per_head) * D;
      const float* __restrict qr = qp[m];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; d++) dot += qr[d] * kr[d];
      scores[m * CHUNK + c - c0] = dot * s.scale;
    }
  }
  const int64_t base = hk0 * rows_per_head;  // this task's first row in the slab
  for (int64_t m = 0; m < M; m++) {
    float* __restrict sr = scores.data() + m * CHUNK;
    const int64_t n = last[m] - c0;
    float top = -FLT_MAX, total = 0.f;
    for (int64_t c = 0; c < n; c++) top = std::max(top, sr[c]);
#pragma omp simd reduction(+ : total)
    for (int64_t c = 0; c < n; c++) {
      sr[c] = expf(sr[c] - top);
      total += sr[c];
    }
    mx_out[base + m] = top;
    sum_out[base + m] = total;  // 0 where the row sees no key of this chunk: the merge skips it
    float* __restrict o = acc_out + (base + m) * D;
    for (int64_t d = 0; d < D; d++) o[d] = 0.f;
  }
  for (int64_t c = c0; c < c1; c++) {
    const float* value = v + (sl[c] * s.Hkv + hk0) * D;
    for (int64_t m = 0; m < M; m++) {
      if (c >= last[m]) continue;
      const float p = scores[m * CHUNK + c - c0];
      const float* __restrict vr = value + (m / rows_per_head) * D;
      float* __restrict o = acc_out + (base + m) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; d++) o[d] += p * vr[d];
    }
  }
}

// Row r of sequence g (r = h * Q + i) from its chunks' partials: with M the largest chunk maximum,
// softmax(s) v = sum_j e^(m_j - M) acc_j / sum_j e^(m_j - M) l_j, the chunks taken in order.
template <int64_t DC>
void merge(const float* mx, const float* sum, const float* acc, float* out, const Layout& s, int64_t slab0,
           int64_t chunks, int64_t g, int64_t r) {
  const int64_t D = DC > 0 ? DC : s.D;
  const int64_t R = s.H * s.Q, h = r / s.Q, i = r % s.Q;
  float top = -FLT_MAX;
  for (int64_t j = 0; j < chunks; j++)
    if (sum[(slab0 + j) * R + r] > 0.f) top = std::max(top, mx[(slab0 + j) * R + r]);
  float* __restrict o = out + ((g * s.Q + i) * s.H + h) * D;  // only this row writes it
  for (int64_t d = 0; d < D; d++) o[d] = 0.f;
  float total = 0.f;
  for (int64_t j = 0; j < chunks; j++) {
    const int64_t at = (slab0 + j) * R + r;
    if (sum[at] == 0.f) continue;
    const float w = expf(mx[at] - top);
    total += w * sum[at];
    const float* __restrict a = acc + at * D;
#pragma omp simd
    for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int64_t d = 0; d < D; d++) o[d] *= inv;
}

template <int64_t DC>
void attend(const float* q, const float* k, const float* v, const int64_t* slots, const int64_t* qpos, float* out,
            const Layout& s) {
  const int64_t D = s.D;
  // Chunks per sequence, as far as its furthest query row sees, and each sequence's first slab.
  std::vector<int64_t> first(s.G + 1, 0);
  for (int64_t g = 0; g < s.G; g++) {
    int64_t n = 1;
    for (int64_t i = 0; i < s.Q; i++) n = std::max(n, std::min(qpos[g * s.Q + i] + 1, s.C));
    first[g + 1] = first[g] + (n + CHUNK - 1) / CHUNK;
  }
  const int64_t slabs = first[s.G], R = s.H * s.Q;
  // Few chunks in all: a task per KV head too, so every thread has work (a row's arithmetic is the same).
  const int64_t per_task = slabs >= 2 * at::get_num_threads() ? s.Hkv : 1, parts = s.Hkv / per_task;
  std::vector<float> mx(slabs * R), sum(slabs * R), acc(slabs * R * D);
  at::parallel_for(0, slabs * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> last;
    std::vector<const float*> qp;
    int64_t g = 0;
    for (int64_t t = begin; t < end; t++) {
      const int64_t slab = t / parts, hk0 = (t % parts) * per_task;
      while (first[g + 1] <= slab) g++;
      chunk<DC>(q, k, v, slots, qpos, mx.data() + slab * R, sum.data() + slab * R, acc.data() + slab * R * D, s, g,
               (slab - first[g]) * CHUNK, hk0, per_task, scores, last, qp);
    }
  });
  at::parallel_for(0, s.G * R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const int64_t g = t / R;
      merge<DC>(mx.data(), sum.data(), acc.data(), out, s, first[g], first[g + 1] - first[g], g, t % R);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slots, const at::Tensor& positions, double scale) {
  // q, out: [G, Q, H, D]; k_cache, v_cache: [slots, Hkv, D]; slots: [G, C] (cache slot of key position c);
  // positions: [G, Q] (query i of sequence g sees key positions [0, positions[g, i]]).
  TORCH_CHECK_VALUE(q.dim() == 4 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
                        k_cache.size(2) == q.size(3) && q.size(2) % k_cache.size(1) == 0 &&
                        k_cache.is_contiguous() && v_cache.is_contiguous() && slots.dim() == 2 &&
                        slots.size(0) == q.size(0) && slots.size(1) > 0 && positions.sizes() == q.sizes().slice(0, 2),
                    "specd::paged_attention: q ", q.sizes(), " against a cache of ", k_cache.sizes(), " and ",
                    v_cache.sizes(), ", slots ", slots.sizes(), ", positions ", positions.sizes());
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                        v_cache.scalar_type() == at::kFloat && slots.scalar_type() == at::kLong &&
                        positions.scalar_type() == at::kLong && q.device().is_cpu() && k_cache.device().is_cpu(),
                    "specd::paged_attention takes float32 CPU tensors and int64 slots and positions");
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous(), pc = positions.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  const Layout s{qc.size(0), qc.size(1), qc.size(2), k_cache.size(1), sc.size(1), qc.size(3),
                 static_cast<float>(scale)};
  if (s.G * s.Q == 0) return out;
  const float *qp = qc.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  const int64_t *sp = sc.data_ptr<int64_t>(), *pp = pc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  switch (qc.size(3)) {
    case 32: attend<32>(qp, kp, vp, sp, pp, op, s); break;
    case 64: attend<64>(qp, kp, vp, sp, pp, op, s); break;
    case 128: attend<128>(qp, kp, vp, sp, pp, op, s); break;
    case 256: attend<256>(qp, kp, vp, sp, pp, op, s); break;
    default: attend<0>(qp, kp, vp, sp, pp, op, s); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor positions, float scale) "
        "-> Tensor");
}
TORCH_LIBRARY_IMPL(specd, CPU, m) { m.impl("paged_attention", &paged_attention); }

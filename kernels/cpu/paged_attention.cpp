// Attention for few query rows per request, straight from SGLang's paged KV pool, on CPU.
//
// The torch path gathers every request's K and V into a padded copy per layer, then runs
// batched matmuls over it: three passes over the KV and a dozen op launches per layer. Here
// each (request, KV head) reads its keys and values once, through the slot table, for all
// the query heads sharing them, in fp32 registers, and writes its packed output rows;
// nothing is padded, gathered or masked. AVX-512 only: other CPUs keep the torch path.
//
// Shapes: q [tokens, heads, dim] (a request's query rows are packed, starting at
// q_starts[b]); k_buffer [slots, kv_heads, dim], v_buffer [slots, kv_heads, v_dim] (last dim
// contiguous); slot_table [bs, >= max kv_len] int64; kv_lens / q_lens / q_starts [bs] int64.
// Query row r of request b sits at key position kv_lens[b] - q_lens[b] + r; a causal row
// sees keys up to its own position, a non-causal one (the draft block) every key.
//
// `store_kv` is the write before it: a forward's new K and V rows into the pool at their
// slots, both buffers in one call (SGLang's CPU fallback is two index_put calls behind a
// dozen Python checks per layer).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "paged_attention.cpp needs AVX-512 (F, BW); the torch path serves other CPUs"
#endif

namespace {

// exp(x) for x <= 0, 16 lanes, to ~1 ulp (Cephes' expf: x = n ln2 + r, a degree-6
// polynomial in r, times 2^n); below -87.3 it underflows to 0 as expf does.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(e, n);
}

// 16 values as fp32: bf16 is the top half of an fp32.
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i wide = _mm512_cvtepu16_epi32(raw);
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as torch's float -> bfloat16 cast (no NaNs reach here).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half);
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

struct Geometry {
  int64_t heads, kv_heads, k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
  int64_t table_stride;
  bool causal;
  float scale;
};

// Where one (request, KV head)'s rows live: keys and values at scattered pool slots.
template <typename T>
struct KvRows {
  const T* k_buffer;
  const T* v_buffer;
  const int64_t* slots;
  int64_t kv_head;
  const Geometry& g;
  const T* key(int64_t j) const {
    return k_buffer + slots[j] * g.k_slot_stride + kv_head * g.k_head_stride;
  }
  const T* value(int64_t j) const {
    return v_buffer + slots[j] * g.v_slot_stride + kv_head * g.v_head_stride;
  }
};

// The 16 horizontal sums of s[0..15] as one vector (lane i = sum of s[i]'s lanes): a
// transpose-and-add tree of 45 shuffles and adds instead of 16 reductions of ~8 each, and
// one vector store instead of 16 scalar ones.
inline __m512 sum16(const __m512* s) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]),
                         _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of s[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Add 128-bit lanes pairwise (0x88 takes lanes 0, 2 of each input, 0xDD lanes 1, 3).
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                  _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                  _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// scores[m, j] = q_m . k_j (q already scaled). Keys go 16 at a time: converted to fp32 once
// into a small block, then each row m makes 16 partial vectors and one `sum16`; the last
// kv_len % 16 keys one at a time, each key row loaded once for all m.
template <typename T, int NV>
void score_keys(const KvRows<T>& kv, int64_t kv_len, const __m512* qv, int64_t m_count,
                float* scores) {
  constexpr int64_t dim = NV * 16;
  alignas(64) float block[16 * dim];
  int64_t j = 0;
  for (; j + 16 <= kv_len; j += 16) {
    for (int64_t jj = 0; jj < 16; ++jj) {
      if (j + 16 + jj < kv_len) {
        _mm_prefetch(reinterpret_cast<const char*>(kv.key(j + 16 + jj)), _MM_HINT_T0);
      }
      const T* key = kv.key(j + jj);
      for (int v = 0; v < NV; ++v) _mm512_store_ps(block + jj * dim + 16 * v, load16(key + 16 * v));
    }
    for (int64_t m = 0; m < m_count; ++m) {
      const __m512* q = qv + m * NV;
      __m512 s[16];
      for (int jj = 0; jj < 16; ++jj) {
        const float* key = block + jj * dim;
        s[jj] = _mm512_mul_ps(q[0], _mm512_load_ps(key));
        for (int v = 1; v < NV; ++v) s[jj] = _mm512_fmadd_ps(q[v], _mm512_load_ps(key + 16 * v), s[jj]);
      }
      _mm512_storeu_ps(scores + m * kv_len + j, sum16(s));
    }
  }
  for (; j < kv_len; ++j) {
    __m512 key[NV];
    for (int v = 0; v < NV; ++v) key[v] = load16(kv.key(j) + 16 * v);
    for (int64_t m = 0; m < m_count; ++m) {
      __m512 s = _mm512_mul_ps(qv[m * NV], key[0]);
      for (int v = 1; v < NV; ++v) s = _mm512_fmadd_ps(qv[m * NV + v], key[v], s);
      scores[m * kv_len + j] = _mm512_reduce_add_ps(s);
    }
  }
}

// In place: the first `visible` scores become exp(s - max), the rest 0; returns 1 / sum.
inline float softmax_numerators(float* s, int64_t visible, int64_t kv_len) {
  float top = s[0];
  for (int64_t j = 1; j < visible; ++j) top = std::max(top, s[j]);
  const __m512 shift = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= visible; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < visible) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (visible - j)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), shift);
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(x));
    _mm512_mask_storeu_ps(s + j, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  for (j = visible; j < kv_len; ++j) s[j] = 0.f;
  return 1.f / _mm512_reduce_add_ps(sum);
}

// acc[m] = sum_j p[m, j] v_j: each value row loaded once, used by all m.
template <typename T, int NV>
void weigh_values(const KvRows<T>& kv, int64_t kv_len, const float* p, int64_t m_count,
                  __m512* acc) {
  for (int64_t j = 0; j < kv_len; ++j) {
    if (j + 4 < kv_len) {
      _mm_prefetch(reinterpret_cast<const char*>(kv.value(j + 4)), _MM_HINT_T0);
    }
    __m512 value[NV];
    for (int v = 0; v < NV; ++v) value[v] = load16(kv.value(j) + 16 * v);
    for (int64_t m = 0; m < m_count; ++m) {
      const __m512 w = _mm512_set1_ps(p[m * kv_len + j]);
      for (int v = 0; v < NV; ++v) acc[m * NV + v] = _mm512_fmadd_ps(w, value[v], acc[m * NV + v]);
    }
  }
}

// One (request, KV head): the rows of its `group` query heads (m = head-in-group * rows + r)
// against every key in fp32. NV = dim / 16.
template <typename T, int NV>
void attend_kv_head(const T* q, const KvRows<T>& kv, int64_t kv_len, int64_t rows, T* out,
                    std::vector<float>& scores, std::vector<__m512>& qv,
                    std::vector<__m512>& acc) {
  constexpr int64_t dim = NV * 16;
  const Geometry& g = kv.g;
  const int64_t group = g.heads / g.kv_heads, m_count = group * rows;
  const int64_t first_head = kv.kv_head * group;
  const __m512 scale = _mm512_set1_ps(g.scale);
  scores.resize(m_count * kv_len);
  qv.resize(m_count * NV);
  acc.assign(m_count * NV, _mm512_setzero_ps());
  for (int64_t i = 0; i < group; ++i) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = q + (r * g.heads + first_head + i) * dim;
      for (int v = 0; v < NV; ++v) {
        qv[(i * rows + r) * NV + v] = _mm512_mul_ps(load16(src + 16 * v), scale);
      }
    }
  }
  score_keys<T, NV>(kv, kv_len, qv.data(), m_count, scores.data());
  std::vector<float> inv_sum(m_count);
  for (int64_t m = 0; m < m_count; ++m) {
    // Row r sits at key position kv_len - rows + r and, if causal, sees keys up to it.
    const int64_t visible = g.causal ? kv_len - rows + m % rows + 1 : kv_len;
    inv_sum[m] = softmax_numerators(scores.data() + m * kv_len, visible, kv_len);
  }
  weigh_values<T, NV>(kv, kv_len, scores.data(), m_count, acc.data());
  for (int64_t i = 0; i < group; ++i) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = i * rows + r;
      T* dst = out + (r * g.heads + first_head + i) * dim;
      const __m512 inv = _mm512_set1_ps(inv_sum[m]);
      for (int v = 0; v < NV; ++v) store16(dst + 16 * v, _mm512_mul_ps(acc[m * NV + v], inv));
    }
  }
}

template <typename T, int NV>
void run(const torch::Tensor& q, const torch::Tensor& k_buffer, const torch::Tensor& v_buffer,
         const torch::Tensor& slot_table, const int64_t* kv, const int64_t* ql, const int64_t* qs,
         const Geometry& g, torch::Tensor& out) {
  constexpr int64_t dim = NV * 16;
  const auto* qp = q.data_ptr<T>();
  const auto* kp = k_buffer.data_ptr<T>();
  const auto* vp = v_buffer.data_ptr<T>();
  const int64_t* table = slot_table.data_ptr<int64_t>();
  auto* op = out.data_ptr<T>();
  const int64_t bs = slot_table.size(0);
  at::parallel_for(0, bs * g.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<__m512> qv, acc;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / g.kv_heads, kv_head = unit % g.kv_heads;
      const KvRows<T> rows{kp, vp, table + b * g.table_stride, kv_head, g};
      attend_kv_head<T, NV>(qp + qs[b] * g.heads * dim, rows, kv[b], ql[b],
                            op + qs[b] * g.heads * dim, scores, qv, acc);
    }
  });
}

}  // namespace

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_buffer,
                              const torch::Tensor& v_buffer, const torch::Tensor& slot_table,
                              const torch::Tensor& kv_lens, const torch::Tensor& q_lens,
                              const torch::Tensor& q_starts, bool causal, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [tokens, heads, dim]");
  TORCH_CHECK(k_buffer.dim() == 3 && v_buffer.dim() == 3,
              "k/v buffers must be [slots, kv_heads, dim]");
  TORCH_CHECK(k_buffer.stride(2) == 1 && v_buffer.stride(2) == 1, "k/v rows must be contiguous");
  TORCH_CHECK(k_buffer.size(2) == q.size(2) && v_buffer.size(2) == q.size(2),
              "q, k and v must share a head dim");
  TORCH_CHECK(k_buffer.scalar_type() == q.scalar_type() &&
                  v_buffer.scalar_type() == q.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(slot_table.scalar_type() == torch::kInt64 && slot_table.dim() == 2 &&
                  slot_table.stride(1) == 1,
              "slot_table must be int64 [bs, keys] with contiguous rows");
  for (const auto* t : {&kv_lens, &q_lens, &q_starts}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() &&
                    t->size(0) == slot_table.size(0),
                "kv_lens, q_lens and q_starts must be int64 [bs]");
  }
  const int64_t bs = slot_table.size(0), dim = q.size(2);
  Geometry g{q.size(1), k_buffer.size(1), k_buffer.stride(0), k_buffer.stride(1),
             v_buffer.stride(0), v_buffer.stride(1), slot_table.stride(0), causal,
             static_cast<float>(scale)};
  TORCH_CHECK(g.heads % g.kv_heads == 0, "query heads must be a multiple of kv heads");
  const int64_t* kv = kv_lens.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(ql[b] >= 1 && ql[b] <= kv[b] && kv[b] <= slot_table.size(1) &&
                    qs[b] >= 0 && qs[b] + ql[b] <= q.size(0),
                "request ", b, ": need 1 <= q_len <= kv_len <= slot_table columns, rows inside q");
  }
  auto out = torch::empty_like(q);
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == torch::kFloat32, "dtype must be bfloat16 or float32");
  TORCH_CHECK(dim == 64 || dim == 128, "head dim must be 64 or 128");
  const auto& kb = k_buffer;
  const auto& vb = v_buffer;
  if (bf16 && dim == 64) run<c10::BFloat16, 4>(q, kb, vb, slot_table, kv, ql, qs, g, out);
  if (bf16 && dim == 128) run<c10::BFloat16, 8>(q, kb, vb, slot_table, kv, ql, qs, g, out);
  if (!bf16 && dim == 64) run<float, 4>(q, kb, vb, slot_table, kv, ql, qs, g, out);
  if (!bf16 && dim == 128) run<float, 8>(q, kb, vb, slot_table, kv, ql, qs, g, out);
  return out;
}

void store_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_buffer,
              torch::Tensor& v_buffer, const torch::Tensor& loc) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k_buffer.dim() == 3 && v_buffer.dim() == 3,
              "k, v and their buffers must be [tokens | slots, kv_heads, dim]");
  TORCH_CHECK(k.size(0) == v.size(0) && loc.dim() == 1 && loc.size(0) == k.size(0),
              "k, v and loc must have one row per token");
  TORCH_CHECK(k.size(1) == k_buffer.size(1) && k.size(2) == k_buffer.size(2) &&
                  v.size(1) == v_buffer.size(1) && v.size(2) == v_buffer.size(2),
              "k and v rows must match their buffers' rows");
  TORCH_CHECK(k.scalar_type() == k_buffer.scalar_type() &&
                  v.scalar_type() == v_buffer.scalar_type(),
              "k and v must have their buffers' dtype");
  const torch::Tensor* all[] = {&k, &v, &k_buffer, &v_buffer};
  for (const torch::Tensor* t : all) {
    TORCH_CHECK(t->stride(2) == 1 && (t->size(1) == 1 || t->stride(1) == t->size(2)),
                "each token's rows must be contiguous (any token stride)");
  }
  TORCH_CHECK(k_buffer.size(0) == v_buffer.size(0), "k and v buffers must have equal slots");
  TORCH_CHECK(loc.scalar_type() == torch::kInt64 && loc.is_contiguous(), "loc must be int64");
  const int64_t tokens = k.size(0), slots = k_buffer.size(0);
  const int64_t* where = loc.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i) {
    TORCH_CHECK(where[i] >= 0 && where[i] < slots, "loc ", where[i], " outside the pool's ",
                slots, " slots");
  }
  const int64_t item = k.element_size();
  const int64_t k_bytes = k.size(1) * k.size(2) * item, v_bytes = v.size(1) * v.size(2) * item;
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kb = static_cast<char*>(k_buffer.data_ptr());
  auto* vb = static_cast<char*>(v_buffer.data_ptr());
  for (int64_t i = 0; i < tokens; ++i) {
    std::memcpy(kb + where[i] * k_buffer.stride(0) * item, kp + i * k.stride(0) * item, k_bytes);
    std::memcpy(vb + where[i] * v_buffer.stride(0) * item, vp + i * v.stride(0) * item, v_bytes);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Attention for few query rows per request over a paged KV pool (CPU, AVX-512)");
  m.def("store_kv", &store_kv, "New K/V rows into the paged pool at their slots (CPU)");
}

// Paged attention for XLA:CPU through the XLA FFI: reads keys and values where they sit
// in the page pool (no gather of the rows' pages into a window first).
//
//   o[t, h, d] = softmax(scale * q[t] . K^T, masked) V   over row r's positions [0, kv_end[r])
//                for the tokens t in [starts[r], starts[r + 1]) of row r
//
//   q           [..., h, d]             T tokens (any leading dims), f32 or bf16; heads
//                                       h = kv * g share kv heads in groups
//   key_pool    [L, P, kv, d, ps]       "kdt" pages; f32, or bf16 bits (u16); or one
//                                       layer's [P, kv, d, ps] (L = 1)
//   value_pool  [L, P, kv, ps, d]       "ktd" pages; same dtype and rank
//   page_table  [b, n] s32              position p of row b: page table[b, p / ps], slot p % ps
//   q_index     [T] s32                 query positions (causal and sliding-window masks)
//   starts      [b + 1] s32             row r's tokens: [starts[r], starts[r + 1]), ascending;
//                                       a token after starts[b] belongs to no row (output 0).
//                                       Rows of s tokens each: starts = s * [0, 1, ..., b]
//   kv_end      [b] s32                 positions >= kv_end[b] are hidden
//   layer       [] s32                  which of the L stacked pools (0 for one layer's)
//
// One task per (row, block of 16 queries) on XLA's intra-op pool (`PoolFor`, pool_for.h).
// A task reads its row's pages in order, every kv head of a page in turn (they are
// adjacent), and uses each kv head's block for the g * s queries that share it: logits
// for every visible position first (QK^T vectorised over a page's positions, the "kdt"
// layout), an exact softmax, then PV (vectorised over head_dim, the "ktd" layout, each
// value row loaded once for up to four queries). A bf16 block is widened to f32 in registers where a few queries read it
// (decode), else once into scratch (a prefill chunk). Sums are in f32; the output is
// rounded to q's dtype once.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pool_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float Bf16ToF32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {  // Round to nearest even (NaN kept quiet).
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// e^x for x <= 0 (softmax arguments), written so the compiler vectorises it: 2^n by the
// exponent bits, e^r on |r| <= ln2/2 by a degree-7 Taylor polynomial (relative error
// below 2e-7 against expf).
inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

struct Call {
  // Shapes.
  int64_t b, tokens, h, d, kv, g, ps, n, pages, layer;
  bool q_bf16, pool_bf16;
  // Options.
  float scale, soft_cap;
  bool causal;
  int32_t window;  // 0: none
  // Data.
  const void* q;
  const void* kpool;
  const void* vpool;
  const int32_t* table;
  const int32_t* q_index;
  const int32_t* starts;
  const int32_t* kv_end;
  void* out;
  std::atomic<bool> bad{false};
  std::atomic<int64_t> bad_page{0};
};

// Where page `page`'s block for kv head `kh` (d * ps elements) sits in `pool`; the kv heads
// of a page are adjacent, so a page's blocks are one range of kv * d * ps elements.
template <typename T>
const T* Block(const Call& c, const void* pool, int64_t page, int64_t kh) {
  const int64_t elems = c.d * c.ps;
  return static_cast<const T*>(pool) + ((c.layer * c.pages + page) * c.kv + kh) * elems;
}

inline float ToF32(float x) { return x; }
inline float ToF32(uint16_t b) { return Bf16ToF32(b); }

// A kv head's block [d * ps] for `nq` queries: bf16 read in place by a few queries (decode:
// widened in registers), else widened to f32 in `tmp` once for all of them (a prefill
// chunk's queries would widen it again for every four); f32 read in place.
template <typename T>
const void* BlockFor(const Call& c, const void* pool, int64_t page, int64_t kh, int64_t nq,
                     float* tmp, bool* wide) {
  const T* b = Block<T>(c, pool, page, kh);
  *wide = sizeof(T) == sizeof(float) || nq > 4;
  if (sizeof(T) == sizeof(float) || nq <= 4) return b;
  for (int64_t i = 0; i < c.d * c.ps; ++i) tmp[i] = ToF32(b[i]);
  return tmp;
}

// 16 floats as one value (GCC/Clang vector extension: one AVX-512 register, two AVX2
// ones); loads and stores go through memcpy (no alignment assumed).
typedef float V16 __attribute__((vector_size(64)));

inline V16 Load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 16 bf16 values (bits) widened to f32 in registers: the pool is read once, no f32 copy.
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));

inline V16 Load16(const uint16_t* p) {
  U16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const U32x16 w = __builtin_convertvector(h, U32x16) << 16;
  V16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline void Store16(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }

// logits[j][t] = q[j] . keys[:, t] for NQ queries (q[j] = q + j * d, logits[j] =
// logits + j * stride) and one page of 16 positions' keys [d, 16]: NQ independent sums
// share each key load.
template <int NQ, typename T>
inline void PageLogits16(const float* __restrict q, const T* __restrict keys, int64_t d,
                         float* __restrict logits, int64_t stride) {
  V16 l[NQ] = {};
  for (int64_t i = 0; i < d; ++i) {
    const V16 k = Load16(keys + i * 16);
    for (int j = 0; j < NQ; ++j) l[j] += q[j * d + i] * k;
  }
  for (int j = 0; j < NQ; ++j) Store16(logits + j * stride, l[j]);
}

// logits for every query over one page (keys [d, ps]); 16-position pages four queries at
// a time, other sizes one query at a time.
template <typename T>
inline void PageLogitsAny(const float* __restrict q, const T* __restrict keys, int64_t d,
                          int64_t ps, int64_t nq, float* __restrict logits, int64_t stride) {
  if (ps == 16) {
    int64_t j = 0;
    for (; j + 4 <= nq; j += 4) PageLogits16<4>(q + j * d, keys, d, logits + j * stride, stride);
    switch (nq - j) {
      case 3: return PageLogits16<3>(q + j * d, keys, d, logits + j * stride, stride);
      case 2: return PageLogits16<2>(q + j * d, keys, d, logits + j * stride, stride);
      case 1: return PageLogits16<1>(q + j * d, keys, d, logits + j * stride, stride);
      default: return;
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    float* l = logits + j * stride;
    for (int64_t t = 0; t < ps; ++t) l[t] = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      const float qi = q[j * d + i];
      for (int64_t t = 0; t < ps; ++t) l[t] += qi * ToF32(keys[i * ps + t]);
    }
  }
}

// max of x[0, n), n >= 1, in 16 lanes (vectorised).
inline float MaxOf(const float* x, int64_t n) {
  float lanes[16];
  for (int j = 0; j < 16; ++j) lanes[j] = x[0];
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    for (int j = 0; j < 16; ++j) lanes[j] = x[t + j] > lanes[j] ? x[t + j] : lanes[j];
  }
  for (; t < n; ++t) lanes[0] = x[t] > lanes[0] ? x[t] : lanes[0];
  float m = lanes[0];
  for (int j = 1; j < 16; ++j) m = lanes[j] > m ? lanes[j] : m;
  return m;
}

// x[t] = e^(x[t] - m) for t in [0, n); returns their sum (16 lanes, vectorised).
inline float ExpSum(float* x, int64_t n, float m) {
  float lanes[16] = {};
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    for (int j = 0; j < 16; ++j) {
      x[t + j] = ExpNonPositive(x[t + j] - m);
      lanes[j] += x[t + j];
    }
  }
  for (; t < n; ++t) {
    x[t] = ExpNonPositive(x[t] - m);
    lanes[0] += x[t];
  }
  float sum = 0.0f;
  for (int j = 0; j < 16; ++j) sum += lanes[j];
  return sum;
}

// acc[:] += sum_t w[t] * values[t, :] for one page of values [ps, d].
template <typename T>
inline void PageValues(const float* __restrict w, const T* __restrict values, int64_t ps,
                       int64_t d, float* __restrict acc) {
  if (d % 16 == 0 && d <= 256) {
    V16 a[16];
    const int64_t nv = d / 16;
    for (int64_t j = 0; j < nv; ++j) a[j] = Load16(acc + j * 16);
    for (int64_t t = 0; t < ps; ++t) {
      const float wt = w[t];
      const T* __restrict v = values + t * d;
      for (int64_t j = 0; j < nv; ++j) a[j] += wt * Load16(v + j * 16);
    }
    for (int64_t j = 0; j < nv; ++j) Store16(acc + j * 16, a[j]);
    return;
  }
  for (int64_t t = 0; t < ps; ++t) {
    const float wt = w[t];
    const T* __restrict v = values + t * d;
    for (int64_t i = 0; i < d; ++i) acc[i] += wt * ToF32(v[i]);
  }
}

// PageValues for NQ queries at once (weights w + j * stride, accumulators acc + j * d),
// d = 16 * NV: each value row is loaded (and widened) once for all of them.
template <int NQ, int NV, typename T>
inline void PageValuesN(const float* __restrict w, int64_t stride, const T* __restrict values,
                        int64_t ps, float* __restrict acc) {
  V16 a[NQ][NV];
  for (int j = 0; j < NQ; ++j)
    for (int k = 0; k < NV; ++k) a[j][k] = Load16(acc + (j * NV + k) * 16);
  for (int64_t t = 0; t < ps; ++t) {
    V16 v[NV];
    for (int k = 0; k < NV; ++k) v[k] = Load16(values + t * NV * 16 + k * 16);
    for (int j = 0; j < NQ; ++j) {
      const float wt = w[j * stride + t];
      for (int k = 0; k < NV; ++k) a[j][k] += wt * v[k];
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int k = 0; k < NV; ++k) Store16(acc + (j * NV + k) * 16, a[j][k]);
}

// PV of nq queries over one page (weights w + j * stride, accumulators acc + j * d); the
// decode shapes (d = 64, up to 4 queries) load each value row once for all of them.
template <typename T>
inline void PageValuesAll(const float* __restrict w, int64_t stride, const T* __restrict values,
                          int64_t ps, int64_t d, int64_t nq, float* __restrict acc) {
  if (d == 64 && nq <= 4) {
    switch (nq) {
      case 4: return PageValuesN<4, 4>(w, stride, values, ps, acc);
      case 3: return PageValuesN<3, 4>(w, stride, values, ps, acc);
      case 2: return PageValuesN<2, 4>(w, stride, values, ps, acc);
      case 1: return PageValuesN<1, 4>(w, stride, values, ps, acc);
      default: return;
    }
  }
  for (int64_t j = 0; j < nq; ++j) PageValues(w + j * stride, values, ps, d, acc + j * d);
}

// Query positions per task: a long chunk (prefill) is split so that both threads get work
// and, under a causal mask, an early block of queries reads only the pages it sees.
constexpr int64_t kQueriesPerTask = 16;

// Task (row bi, queries [s0, s0 + sc)), every kv head.
template <typename T>
// Row bi's queries [s0, s0 + sc) (token indices into q).
void RunTask(Call& c, int64_t bi, int64_t s0, int64_t sc, std::vector<float>& scratch) {
  const int64_t d = c.d, ps = c.ps, nk = c.kv, nq = c.g * sc;  // nq: queries per kv head
  const int32_t* qidx = c.q_index + s0;
  int64_t end = std::min<int64_t>(c.kv_end[bi], c.n * ps);
  int32_t qmin = qidx[0], qmax = qidx[0];
  for (int64_t i = 1; i < sc; ++i) qmin = std::min(qmin, qidx[i]), qmax = std::max(qmax, qidx[i]);
  if (c.causal) end = std::min<int64_t>(end, static_cast<int64_t>(qmax) + 1);
  int64_t begin = 0;
  if (c.window > 0) begin = std::max<int64_t>(0, static_cast<int64_t>(qmin) - (c.window - 1));
  const int64_t p0 = begin / ps;  // first page
  const int64_t p1 = end > begin ? (end + ps - 1) / ps : p0;  // one past the last page
  const int64_t len = (p1 - p0) * ps;
  // Scratch, per kv head kh and query qq (kq = kh * nq + qq): queries [kq, d], weights
  // [kq, len], accumulators [kq, d], denominators [kq]; one widened block [d * ps].
  const int64_t nkq = nk * nq;
  scratch.resize(nkq * d + nkq * len + nkq * d + nkq + d * ps);
  float* qf = scratch.data();
  float* logits = qf + nkq * d;
  float* acc = logits + nkq * len;
  float* denom = acc + nkq * d;
  float* tmp = denom + nkq;
  bool wide = false;
  for (int64_t kh = 0; kh < nk; ++kh) {
    for (int64_t gi = 0; gi < c.g; ++gi) {
      for (int64_t si = 0; si < sc; ++si) {
        const int64_t src = ((s0 + si) * c.h + kh * c.g + gi) * d;
        float* dst = qf + (kh * nq + gi * sc + si) * d;
        if (c.q_bf16) {
          const uint16_t* q = static_cast<const uint16_t*>(c.q) + src;
          for (int64_t i = 0; i < d; ++i) dst[i] = Bf16ToF32(q[i]) * c.scale;
        } else {
          const float* q = static_cast<const float*>(c.q) + src;
          for (int64_t i = 0; i < d; ++i) dst[i] = q[i] * c.scale;
        }
      }
    }
  }
  const int32_t* row_table = c.table + bi * c.n;
  for (int64_t pg = p0; pg < p1; ++pg) {  // Every entry is a page of the pool.
    if (row_table[pg] < 0 || row_table[pg] >= c.pages) {
      c.bad_page.store(row_table[pg]);
      c.bad.store(true);
      return;
    }
  }
  // Logits: keys page by page (a page's kv heads are adjacent), [d, ps] blocks.
  for (int64_t pg = p0; pg < p1; ++pg) {
    for (int64_t kh = 0; kh < nk; ++kh) {
      const void* block = BlockFor<T>(c, c.kpool, row_table[pg], kh, nq, tmp, &wide);
      float* l = logits + kh * nq * len + (pg - p0) * ps;
      if (wide) {
        PageLogitsAny(qf + kh * nq * d, static_cast<const float*>(block), d, ps, nq, l, len);
      } else {
        PageLogitsAny(qf + kh * nq * d, static_cast<const T*>(block), d, ps, nq, l, len);
      }
    }
  }
  // Softmax weights per query over its visible positions [lo, hi) (relative to page p0);
  // every other position weighs 0.
  for (int64_t kq = 0; kq < nkq; ++kq) {
    const int64_t qi = qidx[kq % nq % sc];
    float* l = logits + kq * len;
    int64_t lo = begin, hi = end;
    if (c.causal) hi = std::min<int64_t>(hi, qi + 1);
    if (c.window > 0) lo = std::max<int64_t>(lo, qi - c.window + 1);
    lo -= p0 * ps, hi -= p0 * ps;
    denom[kq] = 0.0f;
    if (hi <= lo) {  // Nothing visible: weights 0, output 0.
      std::fill(l, l + len, 0.0f);
      continue;
    }
    if (c.soft_cap > 0.0f) {
      for (int64_t t = lo; t < hi; ++t) l[t] = c.soft_cap * std::tanh(l[t] / c.soft_cap);
    }
    const float sum = ExpSum(l + lo, hi - lo, MaxOf(l + lo, hi - lo));
    std::fill(l, l + lo, 0.0f);
    std::fill(l + hi, l + len, 0.0f);
    denom[kq] = sum;
  }
  // PV: values page by page, [ps, d] blocks.
  std::fill(acc, acc + nkq * d, 0.0f);
  for (int64_t pg = p0; pg < p1; ++pg) {
    for (int64_t kh = 0; kh < nk; ++kh) {
      const void* block = BlockFor<T>(c, c.vpool, row_table[pg], kh, nq, tmp, &wide);
      const float* w = logits + kh * nq * len + (pg - p0) * ps;
      if (wide) {
        PageValuesAll(w, len, static_cast<const float*>(block), ps, d, nq, acc + kh * nq * d);
      } else {
        PageValuesAll(w, len, static_cast<const T*>(block), ps, d, nq, acc + kh * nq * d);
      }
    }
  }
  for (int64_t kh = 0; kh < nk; ++kh) {
    for (int64_t gi = 0; gi < c.g; ++gi) {
      for (int64_t si = 0; si < sc; ++si) {
        const int64_t kq = kh * nq + gi * sc + si;
        const float inv = denom[kq] > 0.0f ? 1.0f / denom[kq] : 0.0f;
        const float* a = acc + kq * d;
        const int64_t dst = ((s0 + si) * c.h + kh * c.g + gi) * d;
        if (c.q_bf16) {
          uint16_t* o = static_cast<uint16_t*>(c.out) + dst;
          for (int64_t i = 0; i < d; ++i) o[i] = F32ToBf16(a[i] * inv);
        } else {
          float* o = static_cast<float*>(c.out) + dst;
          for (int64_t i = 0; i < d; ++i) o[i] = a[i] * inv;
        }
      }
    }
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kpool,
                              ffi::AnyBuffer vpool, ffi::Buffer<ffi::S32> table,
                              ffi::Buffer<ffi::S32> q_index, ffi::Buffer<ffi::S32> starts,
                              ffi::Buffer<ffi::S32> kv_end, ffi::Buffer<ffi::S32> layer,
                              float scale, float soft_cap, int32_t causal, int32_t window,
                              ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = kpool.dimensions(), vd = vpool.dimensions();
  auto td = table.dimensions();
  // Pools [L, P, ...] (L stacked layers, `layer` picks one) or one layer's [P, ...].
  const bool stacked = kd.size() == 5;
  if (qd.size() < 2 || (kd.size() != 4 && !stacked) || vd.size() != kd.size() ||
      td.size() != 2) {
    return ffi::Error::InvalidArgument(
        "jl_paged_attention: need q [..., h, d], pools [(L,) P, kv, d, ps] / "
        "[(L,) P, kv, ps, d] and a page table [b, n]");
  }
  const size_t o = stacked ? 1 : 0;
  const int64_t layers = stacked ? kd[0] : 1;
  Call c;
  c.h = qd[qd.size() - 2], c.d = qd[qd.size() - 1], c.b = td[0], c.n = td[1];
  c.tokens = 1;
  for (size_t i = 0; i + 2 < qd.size(); ++i) c.tokens *= qd[i];
  c.pages = kd[o], c.kv = kd[o + 1], c.ps = kd[o + 3];
  if (kd[o + 2] != c.d || (stacked && vd[0] != kd[0]) || vd[o] != c.pages ||
      vd[o + 1] != c.kv || vd[o + 2] != c.ps || vd[o + 3] != c.d || c.kv <= 0 ||
      c.h % c.kv != 0 || q_index.element_count() != c.tokens ||
      starts.element_count() != c.b + 1 || kv_end.element_count() != c.b) {
    return ffi::Error::InvalidArgument("jl_paged_attention: shapes of q, pools, page table, "
                                       "q_index, starts and kv_end do not agree");
  }
  c.g = c.h / c.kv;
  c.layer = layer.typed_data()[0];
  if (c.layer < 0 || c.layer >= layers) {
    return ffi::Error::InvalidArgument("jl_paged_attention: layer " + std::to_string(c.layer) +
                                       " of " + std::to_string(layers) + " stacked pools");
  }
  c.q_bf16 = q.element_type() == ffi::BF16;
  if (!c.q_bf16 && q.element_type() != ffi::F32) {
    return ffi::Error::InvalidArgument("jl_paged_attention: q must be f32 or bf16");
  }
  c.pool_bf16 = kpool.element_type() == ffi::U16;
  if ((!c.pool_bf16 && kpool.element_type() != ffi::F32) ||
      vpool.element_type() != kpool.element_type()) {
    return ffi::Error::InvalidArgument(
        "jl_paged_attention: pools must both be f32 or both bf16 bits (u16)");
  }
  c.scale = scale, c.soft_cap = soft_cap, c.causal = causal != 0, c.window = window;
  c.q = q.untyped_data(), c.kpool = kpool.untyped_data(), c.vpool = vpool.untyped_data();
  c.table = table.typed_data(), c.q_index = q_index.typed_data();
  c.starts = starts.typed_data(), c.kv_end = kv_end.typed_data();
  c.out = out->untyped_data();
  // Tasks: (row, first query, queries) for every block of up to 16 of a row's queries.
  std::vector<int64_t> tasks;
  for (int64_t r = 0; r < c.b; ++r) {
    const int64_t lo = c.starts[r], hi = c.starts[r + 1];
    if (lo < 0 || hi < lo || hi > c.tokens) {
      return ffi::Error::InvalidArgument(
          "jl_paged_attention: row " + std::to_string(r) + "'s tokens [" + std::to_string(lo) +
          ", " + std::to_string(hi) + ") are not ascending within the " +
          std::to_string(c.tokens) + " queries");
    }
    for (int64_t s0 = lo; s0 < hi; s0 += kQueriesPerTask) {
      tasks.insert(tasks.end(), {r, s0, std::min(kQueriesPerTask, hi - s0)});
    }
  }
  const int64_t covered = c.b > 0 ? c.starts[c.b] : 0;  // Tokens of no row: output 0.
  const int64_t row_bytes = c.h * c.d * (c.q_bf16 ? 2 : 4);
  std::memset(static_cast<char*>(c.out) + covered * row_bytes, 0,
              (c.tokens - covered) * row_bytes);
  const int64_t total = static_cast<int64_t>(tasks.size()) / 3;
  jaxlearn::PoolFor(pool, total, std::min<int64_t>(pool.num_threads(), total) - 1,
                    [&](int64_t i) {
                      thread_local std::vector<float> scratch;
                      const int64_t* t = tasks.data() + 3 * i;
                      if (c.pool_bf16) {
                        RunTask<uint16_t>(c, t[0], t[1], t[2], scratch);
                      } else {
                        RunTask<float>(c, t[0], t[1], t[2], scratch);
                      }
                    });
  if (c.bad.load()) {
    return ffi::Error::InvalidArgument("jl_paged_attention: page table entry " +
                                       std::to_string(c.bad_page.load()) + " is outside the " +
                                       std::to_string(c.pages) + "-page pool");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("window")
                                  .Ret<ffi::AnyBuffer>());

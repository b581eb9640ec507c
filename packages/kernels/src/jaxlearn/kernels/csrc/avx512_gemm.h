// AVX-512 F32 / BF16 / VNNI matmul on weights packed in column panels: the packed GEMM for
// x86 hosts where oneMKL's GEMMs take a slow generic path (non-Intel CPUs; measured on AMD
// Zen 4: bf16 and int8 4-5x slower than XLA's own dots, packed f32 0.5-0.6x at one row,
// see packed_gemm.py).
//
// A weight W [K, N] is packed once into panels of kPanel = 32 columns (two zmm of f32 or
// int32 results), the K dimension interleaved the way the dot instructions read it:
//   f32:  panel[k][c]             (VFMADD231PS: one product per lane)
//   bf16: panel[k / 2][c][k % 2]  (VDPBF16PS: a pair of bf16 products per f32 lane)
//   int8: panel[k / 4][c][k % 4]  (VPDPBUSD: four u8 x s8 products per int32 lane)
// K is zero-padded to a multiple of 2 (4), N to a multiple of 32. A register block of up
// to kRows rows x 32 columns keeps 2 * kRows accumulators; each step loads the panel's next
// two vectors once and broadcasts one row's element (pair, quad) of x per row.
//
//   f32:  y[M, N] f32 = x[M, K] f32 @ W
//   bf16: y[M, N] f32 = x[M, K] bf16 @ W   (f32 accumulation; the instruction treats bf16
//         denormals as zero)
//   int8: y[M, N] f32 = f32(xq[M, K] u8 @ q + off) * sx[M] * s   (xq = q_x + 128 and
//         off = -128 colsum(q), so the int32 sum is exactly q_x @ q; the scaling is the
//         one the oneMKL path applies, so both give the same floats)
//
// The functions carry their own target attributes, so this compiles on any x86-64 host;
// a caller runs them only where the CPU has AVX512F (AVX512_BF16, AVX512_VNNI) (`HostHas*`).
#ifndef JAXLEARN_KERNELS_AVX512_GEMM_H_
#define JAXLEARN_KERNELS_AVX512_GEMM_H_

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace jaxlearn::avx512 {

constexpr int64_t kPanel = 32;
constexpr int kRows = 8;

inline int64_t Panels(int64_t n) { return (n + kPanel - 1) / kPanel; }
inline int64_t Steps(int64_t k, int64_t per) { return (k + per - 1) / per; }
enum class Kind { kF32, kBf16, kInt8 };
// Bytes of one packed panel and of the whole packed weight.
inline int64_t PanelBytes(int64_t k, Kind kind) {
  switch (kind) {
    case Kind::kF32: return k * kPanel * 4;
    case Kind::kBf16: return Steps(k, 2) * kPanel * 2 * 2;
    default: return Steps(k, 4) * kPanel * 4;
  }
}
inline int64_t PackedBytes(int64_t k, int64_t n, Kind kind) {
  return Panels(n) * PanelBytes(k, kind);
}

// AVX512F + AVX512BW, what every kernel here needs (the f32 one nothing more).
inline bool HostHasAvx512() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (b & (1u << 16)) && (b & (1u << 30));
}
inline bool HostHasBf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return (a & (1u << 5)) && HostHasAvx512();  // AVX512_BF16
}
inline bool HostHasVnni() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (c & (1u << 11)) && HostHasAvx512();  // AVX512_VNNI
}
// Whether this CPU runs the kernel for weights of `kind`.
inline bool HostRuns(Kind kind) {
  return kind == Kind::kF32 ? HostHasAvx512() : kind == Kind::kBf16 ? HostHasBf16()
                                                                    : HostHasVnni();
}

// Packs w [k, n] (row major) into out (PackedBytes bytes): panels of kPanel columns, each
// `group` consecutive rows of a column adjacent (f32: T = float, group 1; bf16: T =
// uint16_t bits, group 2; int8: T = int8_t, group 4).
template <typename T, int group>
void PackPanels(const T* w, int64_t k, int64_t n, T* out) {
  for (int64_t p = 0; p < Panels(n); ++p) {
    for (int64_t g = 0; g < Steps(k, group); ++g) {
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t col = p * kPanel + c;
        for (int64_t e = 0; e < group; ++e) {
          const int64_t row = group * g + e;
          *out++ = (row < k && col < n) ? w[row * n + col] : T(0);
        }
      }
    }
  }
}
inline void PackF32(const float* w, int64_t k, int64_t n, float* out) {
  PackPanels<float, 1>(w, k, n, out);
}
inline void PackBf16(const uint16_t* w, int64_t k, int64_t n, uint16_t* out) {
  PackPanels<uint16_t, 2>(w, k, n, out);
}
inline void PackInt8(const int8_t* q, int64_t k, int64_t n, int8_t* out) {
  PackPanels<int8_t, 4>(q, k, n, out);
}

// Lane masks of the two result vectors for a panel with `cols` (1..32) valid columns.
inline __mmask16 Mask0(int64_t cols) {
  return cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
}
inline __mmask16 Mask1(int64_t cols) {
  return cols >= 32 ? __mmask16(0xFFFF) : cols <= 16 ? __mmask16(0)
                                                     : __mmask16((1u << (cols - 16)) - 1);
}

// x's elements [i, i + width) of a row as one 32-bit lane, zeros past `k` (no read past it).
template <typename T, int width>
inline uint32_t Group(const T* row, int64_t i, int64_t k) {
  uint32_t g = 0;
  if (i + width <= k) {
    std::memcpy(&g, row + i, sizeof(g));
  } else {
    std::memcpy(&g, row + i, static_cast<size_t>(k - i) * sizeof(T));
  }
  return g;
}

inline int Load32(const void* p) {
  int v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The int8 result scaling of one panel, which both int8 kernels (these and amx_gemm.h)
// apply, so they give the same floats: y = f32(acc + off) * sx * s, `cols` valid columns.
struct Int8Scale {
  __mmask16 m0, m1;
  __m512i off0, off1;
  __m512 s0, s1;
};
__attribute__((target("avx512f,avx512bw"))) inline Int8Scale LoadInt8Scale(
    const int32_t* off, const float* s, int64_t cols) {
  Int8Scale c;
  c.m0 = Mask0(cols);
  c.m1 = Mask1(cols);
  c.off0 = _mm512_maskz_loadu_epi32(c.m0, off);
  c.off1 = _mm512_maskz_loadu_epi32(c.m1, off + 16);
  c.s0 = _mm512_maskz_loadu_ps(c.m0, s);
  c.s1 = _mm512_maskz_loadu_ps(c.m1, s + 16);
  return c;
}
// One row's int32 sums of the panel's columns 0-15 (a0) and 16-31 (a1), row scale sx.
__attribute__((target("avx512f,avx512bw"))) inline void StoreInt8Row(const Int8Scale& c,
                                                                     __m512i a0, __m512i a1,
                                                                     float sx, float* y) {
  const __m512 rs = _mm512_set1_ps(sx);
  const __m512 v0 = _mm512_cvtepi32_ps(_mm512_add_epi32(a0, c.off0));
  const __m512 v1 = _mm512_cvtepi32_ps(_mm512_add_epi32(a1, c.off1));
  _mm512_mask_storeu_ps(y, c.m0, _mm512_mul_ps(_mm512_mul_ps(v0, rs), c.s0));
  _mm512_mask_storeu_ps(y + 16, c.m1, _mm512_mul_ps(_mm512_mul_ps(v1, rs), c.s1));
}

// R rows of x (stride ldx) times one f32 panel -> y (stride ldy), `cols` valid columns.
template <int R>
__attribute__((target("avx512f,avx512bw"))) void F32Block(const float* x, int64_t ldx,
                                                           int64_t k, const float* panel,
                                                           float* y, int64_t ldy,
                                                           int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const float* wp = panel;
  for (int64_t s = 0; s < k; ++s) {
    const __m512 w0 = _mm512_loadu_ps(wp);
    const __m512 w1 = _mm512_loadu_ps(wp + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + s]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
    wp += kPanel;
  }
  const __mmask16 m0 = Mask0(cols), m1 = Mask1(cols);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);
  }
}

// R rows of x (stride ldx) times one bf16 panel -> y (stride ldy), `cols` valid columns.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void Bf16Block(
    const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* panel, float* y, int64_t ldy,
    int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  // Whole pairs are one 32-bit load broadcast each (vpbroadcastd from memory); the last,
  // half pair of an odd k is built without reading past the row.
#define JL_BF16_STEP(XPAIR)                                                  \
  {                                                                         \
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);                   \
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + kPanel);          \
    for (int r = 0; r < R; ++r) {                                           \
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(XPAIR);               \
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);                      \
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);                      \
    }                                                                       \
    wp += 2 * kPanel;                                                       \
  }
  const int64_t full = k / 2;
  const uint16_t* wp = panel;
  for (int64_t s = 0; s < full; ++s) JL_BF16_STEP(Load32(x + r * ldx + 2 * s))
  if (k % 2) JL_BF16_STEP(static_cast<int>(Group<uint16_t, 2>(x + r * ldx, 2 * full, k)))
#undef JL_BF16_STEP
  const __mmask16 m0 = Mask0(cols), m1 = Mask1(cols);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);
  }
}

// R rows of xq (u8, stride ldx) times one int8 panel, offsets / scales of its columns.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void Int8Block(
    const uint8_t* xq, int64_t ldx, int64_t k, const int8_t* panel, const int32_t* off,
    const float* sx, const float* s, float* y, int64_t ldy, int64_t cols) {
  __m512i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
#define JL_INT8_STEP(XQUAD)                                                 \
  {                                                                         \
    const __m512i w0 = _mm512_loadu_si512(wp);                              \
    const __m512i w1 = _mm512_loadu_si512(wp + 2 * kPanel);                 \
    for (int r = 0; r < R; ++r) {                                           \
      const __m512i xb = _mm512_set1_epi32(XQUAD);                          \
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);                   \
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);                   \
    }                                                                       \
    wp += 4 * kPanel;                                                       \
  }
  const int64_t full = k / 4;
  const int8_t* wp = panel;
  for (int64_t st = 0; st < full; ++st) JL_INT8_STEP(Load32(xq + r * ldx + 4 * st))
  if (k % 4) JL_INT8_STEP(static_cast<int>(Group<uint8_t, 4>(xq + r * ldx, 4 * full, k)))
#undef JL_INT8_STEP
  const Int8Scale c = LoadInt8Scale(off, s, cols);
  for (int r = 0; r < R; ++r) StoreInt8Row(c, acc[r][0], acc[r][1], sx[r], y + r * ldy);
}

// F32Block / Bf16Block / Int8Block for `rows` (1..R) rows: the block of that height.
// (T = float: F32Block; T = uint16_t: Bf16Block.)
template <int R, typename T>
void FloatRows(int64_t rows, const T* x, int64_t k, const T* panel, float* y, int64_t ldy,
               int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return FloatRows<R - 1>(rows, x, k, panel, y, ldy, cols);
  }
  if constexpr (std::is_same_v<T, float>) {
    F32Block<R>(x, k, k, panel, y, ldy, cols);
  } else {
    Bf16Block<R>(x, k, k, panel, y, ldy, cols);
  }
}
template <int R>
void Int8Rows(int64_t rows, const uint8_t* xq, int64_t k, const int8_t* panel,
              const int32_t* off, const float* sx, const float* s, float* y, int64_t ldy,
              int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return Int8Rows<R - 1>(rows, xq, k, panel, off, sx, s, y, ldy, cols);
  }
  Int8Block<R>(xq, k, k, panel, off, sx, s, y, ldy, cols);
}

// Every row of x [m, k] times panels [p0, p1) of a packed float weight [k, n] -> y [m, n]
// (T = float: f32; T = uint16_t: bf16 bits).
template <typename T>
inline void FloatPanels(const T* x, int64_t m, int64_t k, int64_t n, const T* w, int64_t p0,
                        int64_t p1, float* y) {
  constexpr bool f32 = std::is_same_v<T, float>;
  const int64_t stride = PanelBytes(k, f32 ? Kind::kF32 : Kind::kBf16) / int64_t(sizeof(T));
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      FloatRows<kRows>(std::min<int64_t>(kRows, m - r0), x + r0 * k, k, w + p * stride,
                       y + r0 * n + p * kPanel, n, cols);
    }
  }
}
inline void F32Panels(const float* x, int64_t m, int64_t k, int64_t n, const float* w,
                      int64_t p0, int64_t p1, float* y) {
  FloatPanels(x, m, k, n, w, p0, p1, y);
}
inline void Bf16Panels(const uint16_t* x, int64_t m, int64_t k, int64_t n, const uint16_t* w,
                       int64_t p0, int64_t p1, float* y) {
  FloatPanels(x, m, k, n, w, p0, p1, y);
}

// The same for an int8 weight: xq [m, k] u8, row scales sx [m], column offsets / scales
// off, s [>= Panels(n) * 32] (zero past n).
inline void Int8Panels(const uint8_t* xq, const float* sx, int64_t m, int64_t k, int64_t n,
                       const int8_t* w, const int32_t* off, const float* s, int64_t p0,
                       int64_t p1, float* y) {
  const int64_t stride = PanelBytes(k, Kind::kInt8);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t c0 = p * kPanel, cols = std::min(kPanel, n - c0);
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      Int8Rows<kRows>(std::min<int64_t>(kRows, m - r0), xq + r0 * k, k, w + p * stride,
                      off + c0, sx + r0, s + c0, y + r0 * n + c0, n, cols);
    }
  }
}

}  // namespace jaxlearn::avx512

#endif  // JAXLEARN_KERNELS_AVX512_GEMM_H_

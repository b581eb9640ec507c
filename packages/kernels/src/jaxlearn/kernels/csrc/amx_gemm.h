// AMX matmul on the panels of avx512_gemm.h: the same packed bf16 / int8 weights, read by
// tile instructions where the CPU has them (Sapphire Rapids and later Xeons).
//
// A panel stores K groups of 32 columns, panel[k / g][c][k % g] (bf16 pairs, g = 2; int8
// quads, g = 4), 128 bytes per group row. So 16 consecutive group rows of 16 columns are
// exactly one B tile of TDPBF16PS / TDPBUSD (16 rows of 64 bytes, row stride 128 bytes).
// A block of up to 32 rows x one panel keeps four 16 x 16 accumulator tiles (C0..C3,
// f32 or int32), two A tiles of 16 rows x 64 bytes read straight from x, and two B
// tiles; each K step of 64 bytes (32 bf16, 64 int8) is four tile loads and four tile dots.
//
//   bf16: y[M, N] f32 = x[M, K] bf16 @ W   (f32 accumulation, bf16 denormals as zero,
//         like the AVX512_BF16 kernel)
//   int8: y[M, N] f32 = f32(xq[M, K] u8 @ q + off) * sx[M] * s   (the AVX512_VNNI
//         kernel's integer sums and scaling, so the same floats)
//
// K must fill whole steps (`AmxFits`: a multiple of 32 bf16 / 64 int8); other shapes take
// the AVX-512 blocks. Rows past a multiple of 16 are tiles with fewer rows (a second tile
// configuration); accumulators go through a 32 x 32 scratch block to y, so the last
// panel's columns past N are never written. Linux hands out the tile state only on
// request (arch_prctl ARCH_REQ_XCOMP_PERM), which `AmxReady` makes once per process.
#ifndef JAXLEARN_KERNELS_AMX_GEMM_H_
#define JAXLEARN_KERNELS_AMX_GEMM_H_

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "avx512_gemm.h"

namespace jaxlearn::amx {

namespace a5 = jaxlearn::avx512;

// The CPU's AMX-TILE plus AMX-BF16 (bf16) or AMX-INT8 (int8), and the tile state granted
// to this process: asked once, and the answer kept (CPUID leaves a VM on every call).
inline bool AmxReady(bool int8) {
  struct Ready {
    bool bf16 = false, int8 = false;
  };
  static const Ready ready = [] {
    Ready r;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return r;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) return r;
    r.bf16 = d & (1u << 22);
    r.int8 = d & (1u << 25);
    return r;
  }();
  return int8 ? ready.int8 : ready.bf16;
}

// One K step is 64 bytes of a row: 32 bf16 or 64 int8 values.
inline bool AmxFits(int64_t k, bool int8) { return k % (int8 ? 64 : 32) == 0; }

// The weight's panels are one contiguous stream; Accumulate prefetches it kPrefetch bytes
// ahead of the B tile loads. Without that, a served bf16 SmolLM2-135M ran at 0.77-0.80x
// of oneMKL's packed GEMM at 8-32 requests in flight on a 2-vCPU Emerald Rapids Xeon; with
// it at 1.06-1.16x (interleaved serving rounds, packages/kernels/README.md).
constexpr int64_t kPrefetch = 8192;

// LDTILECFG's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 = C of the top rows (columns 0-15, 16-31), 2, 3 = C of the bottom rows,
// 4 / 5 = A top / bottom, 6 / 7 = B columns 0-15 / 16-31, all 64 bytes wide. `top`
// (1..16) and `bottom` (0..16) rows; a bottom of 0 leaves tiles 2, 3, 5 unconfigured.
__attribute__((target("amx-tile"))) inline void Configure(int top, int bottom) {
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(top), cfg.colsb[t] = 64;
  if (bottom > 0) {
    for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(bottom), cfg.colsb[t] = 64;
  }
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// The accumulators of one block: rows [0, top + bottom) of x (bytes, row stride `ldx`
// bytes, K of `kbytes` bytes) times one panel (row stride 128 bytes per K step of 4 bytes)
// -> tmp [32][32] (f32 or int32). The tiles must be configured for (top, bottom).
template <bool kInt8, bool kBottom>
__attribute__((target("amx-tile,amx-bf16,amx-int8,sse"))) void Accumulate(
    const uint8_t* x, int64_t ldx, int64_t kbytes, const uint8_t* panel, void* tmp) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kBottom) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint8_t* x1 = x + 16 * ldx;
  // C tile += A tile . B tile: TDPBUSD (u8 x s8 -> int32) or TDPBF16PS (bf16 -> f32). A
  // macro, since the intrinsics paste their tile numbers into the instruction text.
#define JL_TILE_DOT(C, A, B) \
  if constexpr (kInt8) {     \
    _tile_dpbusd(C, A, B);   \
  } else {                   \
    _tile_dpbf16ps(C, A, B); \
  }
  for (int64_t kb = 0; kb < kbytes; kb += 64) {
    // A K step of 64 bytes is 16 panel rows of 2 * kPanel * 2 bytes (bf16 pairs, int8
    // quads: 128 bytes each).
    const uint8_t* b = panel + kb * a5::kPanel;
    for (int j = 0; j < 32; ++j) {  // The weight's stream, kPrefetch bytes ahead.
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetch + 64 * j), _MM_HINT_T0);
    }
    _tile_loadd(6, b, 4 * a5::kPanel);
    _tile_loadd(7, b + 64, 4 * a5::kPanel);
    _tile_loadd(4, x + kb, ldx);
    JL_TILE_DOT(0, 4, 6)
    JL_TILE_DOT(1, 4, 7)
    if constexpr (kBottom) {
      _tile_loadd(5, x1 + kb, ldx);
      JL_TILE_DOT(2, 5, 6)
      JL_TILE_DOT(3, 5, 7)
    }
  }
#undef JL_TILE_DOT
  auto* t = static_cast<uint8_t*>(tmp);
  _tile_stored(0, t, 128);
  _tile_stored(1, t + 64, 128);
  if constexpr (kBottom) {
    _tile_stored(2, t + 16 * 128, 128);
    _tile_stored(3, t + 16 * 128 + 64, 128);
  }
}

// Every row of x [m, k] (bf16 or u8) times panels [p0, p1) of a packed weight [k, n]
// -> y [m, n]; `finish(r0, rows, p, acc)` writes one block's accumulators acc [32][32]
// (rows `rows` from row r0, panel p) to y. k must satisfy AmxFits, AmxReady must hold.
template <bool kInt8, typename Finish>
__attribute__((target("amx-tile"))) void Panels(const uint8_t* x, int64_t m, int64_t k,
                                                const uint8_t* w, int64_t p0, int64_t p1,
                                                const Finish& finish) {
  const int64_t ldx = kInt8 ? k : 2 * k;
  const int64_t stride = a5::PanelBytes(k, kInt8 ? a5::Kind::kInt8 : a5::Kind::kBf16);
  alignas(64) int32_t acc[32][32];
  int top = -1, bottom = -1;
  for (int64_t r0 = 0; r0 < m; r0 += 32) {
    const int t = static_cast<int>(std::min<int64_t>(16, m - r0));
    const int b = static_cast<int>(std::clamp<int64_t>(m - r0 - 16, 0, 16));
    if (t != top || b != bottom) Configure(top = t, bottom = b);
    for (int64_t p = p0; p < p1; ++p) {
      if (b > 0) {
        Accumulate<kInt8, true>(x + r0 * ldx, ldx, ldx, w + p * stride, acc);
      } else {
        Accumulate<kInt8, false>(x + r0 * ldx, ldx, ldx, w + p * stride, acc);
      }
      finish(r0, t + b, p, acc);
    }
  }
  _tile_release();
}

// bf16: y = x @ W for panels [p0, p1) (the f32 accumulators as they are).
inline void Bf16Panels(const uint16_t* x, int64_t m, int64_t k, int64_t n, const uint16_t* w,
                       int64_t p0, int64_t p1, float* y) {
  Panels<false>(reinterpret_cast<const uint8_t*>(x), m, k,
                reinterpret_cast<const uint8_t*>(w), p0, p1,
                [&](int64_t r0, int rows, int64_t p, const int32_t (*acc)[32]) {
                  const int64_t c0 = p * a5::kPanel, cols = std::min(a5::kPanel, n - c0);
                  for (int r = 0; r < rows; ++r) {
                    std::memcpy(y + (r0 + r) * n + c0, acc[r],
                                static_cast<size_t>(cols) * sizeof(float));
                  }
                });
}

// int8: y = f32(xq @ q + off) * sx * s for panels [p0, p1), with the AVX512_VNNI
// kernel's scaling (`avx512::StoreInt8Row`), so both give the same floats.
__attribute__((target("avx512f,avx512bw"))) inline void Int8Finish(
    const int32_t (*acc)[32], int rows, const int32_t* off, const float* sx, const float* s,
    float* y, int64_t ldy, int64_t cols) {
  const a5::Int8Scale c = a5::LoadInt8Scale(off, s, cols);
  for (int r = 0; r < rows; ++r) {
    a5::StoreInt8Row(c, _mm512_load_si512(acc[r]), _mm512_load_si512(acc[r] + 16), sx[r],
                     y + r * ldy);
  }
}

inline void Int8Panels(const uint8_t* xq, const float* sx, int64_t m, int64_t k, int64_t n,
                       const int8_t* w, const int32_t* off, const float* s, int64_t p0,
                       int64_t p1, float* y) {
  Panels<true>(xq, m, k, reinterpret_cast<const uint8_t*>(w), p0, p1,
               [&](int64_t r0, int rows, int64_t p, const int32_t (*acc)[32]) {
                 const int64_t c0 = p * a5::kPanel;
                 Int8Finish(acc, rows, off + c0, sx + r0, s + c0, y + r0 * n + c0, n,
                            std::min(a5::kPanel, n - c0));
               });
}

}  // namespace jaxlearn::amx

#endif  // JAXLEARN_KERNELS_AMX_GEMM_H_

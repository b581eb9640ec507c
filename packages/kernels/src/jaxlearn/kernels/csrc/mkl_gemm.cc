// oneMKL GEMMs for XLA:CPU through the XLA FFI. First, a prepacked-weight matmul on oneMKL's
// packed GEMM API
// (cblas_sgemm_pack / _compute, cblas_gemm_bf16bf16f32_pack / _compute,
// cblas_gemm_s8u8s32_pack / _compute), or for bf16 and int8 weights on the AVX-512 BF16 /
// VNNI kernels of avx512_gemm.h (backend kAvx512: hosts where oneMKL's are slow).
//
// XLA:CPU's dots repack the weight on every call, which dominates a decode step with few
// rows. Here each weight is packed once, into `parts` column blocks (one per thread), and
// kept in a table owned by this library; a program refers to it by an int32 id, so a
// scanned layer stack slices an id instead of copying a weight.
//
//   y[M, N] f32 = x[M, K] (f32, or bf16 for bf16 weights) @ W[K, N]
//
// int8 weights (q [K, N] int8, per-column f32 scales s [N]), a second target:
//
//   y[M, N] f32 = f32((xq[M, K] - 128) @ q) * sx[M] * s
//
// where the caller (`kernels.packed_matmul(..., int8=True)`) quantized x's rows in XLA
// (`quantize_rows`: sx and q_x) and passed xq = q_x + 128 as uint8, which oneMKL's int8
// GEMM takes; the 128 * colsum(q) that adds is removed through its row offset, exactly,
// in int32. Integer sums do not depend on the order, so a row's result is the same in a
// call of any number of rows, and equal to `int8_matmul`'s.
//
// Second, a plain f32 GEMM (cblas_sgemm) with either operand transposed, for dots whose
// operands change every call (a training step's forward and backward dots, `kernels.sgemm`):
//
//   c[M, N] f32 = op(a) @ op(b),   op(t) = t or t^T (attributes trans_a, trans_b)
//   c[M, N] f32 = op(a) @ op(b) + d                 (a third target: the sum in the GEMM)
//
// split into `parts` row or column blocks (the longer side of c), each a task on the pool
// (rank-3 operands: one such GEMM per leading batch entry, the entries split into parts);
// the handler returns an FFI future at once (asynchronous: see SgemmImpl).
//
// MKL is opened at run time (jl_init) and runs sequentially; the packed GEMMs' column
// blocks run on XLA's intra-op thread pool (`PoolFor`, pool_for.h). Packed blocks are mapped pages of
// their own (mmap), never the malloc heap: with the heap tuning of tools/malloc_env.sh
// (no mmap by malloc) the weights of a model sat inside the brk heap, and XLA's f32 dots
// of the same process ran 1.5x slower while they were held.
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "amx_gemm.h"
#include "avx512_gemm.h"
#include "pool_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
constexpr int kRowOffset = 171;  // oc[N]: one offset per column of C.
constexpr int kF32 = 0, kBf16 = 1, kInt8 = 2;
constexpr int kMklBackend = 0, kAvx512 = 1;
// The avx512 panels' kind of a dtype code (kF32, kBf16, kInt8).
jaxlearn::avx512::Kind KindOf(int dtype) {
  using jaxlearn::avx512::Kind;
  return dtype == kF32 ? Kind::kF32 : dtype == kBf16 ? Kind::kBf16 : Kind::kInt8;
}
constexpr int64_t kRowBlock = 32;  // int8: rows per int32 scratch block.
constexpr int kThreadingSequential = 1, kInterfaceLp64 = 0;

// oneMKL's LP64 interface (MKL_INT = 32-bit int; set explicitly in jl_init).
using MklInt = int32_t;
using PackSizeFn = size_t (*)(int, MklInt, MklInt, MklInt);
using SPackFn = void (*)(int, int, int, MklInt, MklInt, MklInt, float, const float*, MklInt,
                         float*);
using SComputeFn = void (*)(int, MklInt, MklInt, MklInt, MklInt, MklInt, const float*, MklInt,
                            const float*, MklInt, float, float*, MklInt);
using BPackFn = void (*)(int, int, int, MklInt, MklInt, MklInt, const uint16_t*, MklInt,
                         uint16_t*);
using BComputeFn = void (*)(int, MklInt, MklInt, MklInt, MklInt, MklInt, float, const uint16_t*,
                            MklInt, const uint16_t*, MklInt, float, float*, MklInt);
using SgemmFn = void (*)(int, int, int, MklInt, MklInt, MklInt, float, const float*, MklInt,
                        const float*, MklInt, float, float*, MklInt);
using IPackFn = void (*)(int, int, int, MklInt, MklInt, MklInt, const void*, MklInt, void*);
using IComputeFn = void (*)(int, MklInt, MklInt, int, MklInt, MklInt, MklInt, float, const void*,
                            MklInt, int8_t, const void*, MklInt, int8_t, float, int32_t*, MklInt,
                            const int32_t*);

struct Mkl {
  PackSizeFn s_size = nullptr, b_size = nullptr;
  SPackFn s_pack = nullptr;
  SComputeFn s_compute = nullptr;
  BPackFn b_pack = nullptr;
  BComputeFn b_compute = nullptr;
  PackSizeFn i_size = nullptr;
  IPackFn i_pack = nullptr;
  IComputeFn i_compute = nullptr;
  SgemmFn sgemm = nullptr;
};
Mkl mkl;

struct Part {
  int64_t n0, n;
  void* buf;
  size_t bytes;  // What oneMKL asked for (`*_pack_get_size`).
};

struct Weight {
  int64_t k, n;
  int dtype;  // kF32, kBf16 or kInt8
  int backend;  // kMklBackend (one part per column block) or kAvx512 (one part, all panels)
  std::vector<Part> parts;
  std::vector<float> scale;       // int8: per column [n] (kAvx512: zeros to the last panel)
  std::vector<int32_t> col_off;   // int8: -128 * colsum(q), the same length
  ~Weight() {
    for (auto& p : parts) munmap(p.buf, p.bytes);
  }
};

constexpr int kMaxWeights = 1 << 20;
std::array<std::atomic<Weight*>, kMaxWeights> table;
std::atomic<int> next_id{0};
std::mutex free_mu;
std::vector<int> free_ids;

void RunPart(const Weight& w, const Part& p, const void* x, int64_t m, float* y) {
  if (w.dtype == kF32) {
    mkl.s_compute(kRowMajor, kNoTrans, kPacked, m, p.n, w.k, static_cast<const float*>(x), w.k,
                  static_cast<const float*>(p.buf), p.n, 0.0f, y + p.n0, w.n);
  } else {
    mkl.b_compute(kRowMajor, kNoTrans, kPacked, m, p.n, w.k, 1.0f,
                  static_cast<const uint16_t*>(x), w.k, static_cast<const uint16_t*>(p.buf),
                  p.n, 0.0f, y + p.n0, w.n);
  }
}

// int8 weight: xq [m, k] (q_x + 128) with row scales sx [m]; int32 blocks of kRowBlock rows.
void RunPartInt8(const Weight& w, const Part& p, const uint8_t* xq, const float* sx, int64_t m,
                 float* y) {
  thread_local std::vector<int32_t> acc;
  acc.resize(static_cast<size_t>(kRowBlock * p.n));
  const int32_t* off = w.col_off.data() + p.n0;
  const float* s = w.scale.data() + p.n0;
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const int64_t mb = r0 + kRowBlock <= m ? kRowBlock : m - r0;
    mkl.i_compute(kRowMajor, kNoTrans, kPacked, kRowOffset, mb, p.n, w.k, 1.0f, xq + r0 * w.k,
                  w.k, 0, p.buf, p.n, 0, 0.0f, acc.data(), p.n, off);
    for (int64_t r = 0; r < mb; ++r) {
      const float rs = sx[r0 + r];
      float* yr = y + (r0 + r) * w.n + p.n0;
      const int32_t* ar = acc.data() + r * p.n;
      for (int64_t j = 0; j < p.n; ++j) yr[j] = static_cast<float>(ar[j]) * rs * s[j];
    }
  }
}

// An avx512 weight's panels over XLA's pool: a few panels per task, claimed dynamically.
template <typename Fn>
void RunPanels(ffi::ThreadPool& pool, const Weight& w, const Fn& fn) {
  const int64_t panels = jaxlearn::avx512::Panels(w.n);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = std::max<int64_t>(1, panels / (4 * threads));
  const int64_t tasks = (panels + per - 1) / per;
  jaxlearn::PoolFor(pool, tasks, std::min(tasks, threads) - 1, [&](int64_t t) {
    fn(t * per, std::min(panels, (t + 1) * per));
  });
}

// The weight an FFI call names by id, or nullptr with `error` saying why (`who` calls).
Weight* Lookup(int32_t i, const char* who, ffi::Error* error) {
  Weight* w = (i >= 0 && i < kMaxWeights) ? table[i].load(std::memory_order_acquire) : nullptr;
  if (w == nullptr) {
    *error = ffi::Error::InvalidArgument(std::string(who) + ": no packed weight with id " +
                                         std::to_string(i) + " (freed, or from another process)");
  }
  return w;
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> id,
                            ffi::ResultBuffer<ffi::F32> y) {
  const int32_t i = id.typed_data()[0];
  ffi::Error error = ffi::Error::Success();
  Weight* w = Lookup(i, "jl_packed_matmul", &error);
  if (w == nullptr) return error;
  auto dims = x.dimensions();
  if (dims.size() != 2 || dims[1] != w->k || dims[0] > INT32_MAX) {
    return ffi::Error::InvalidArgument("jl_packed_matmul: x must be [rows, " +
                                       std::to_string(w->k) + "] for weight " +
                                       std::to_string(i));
  }
  const bool bf16 = x.element_type() == ffi::BF16;
  if (w->dtype == kInt8 || bf16 != (w->dtype == kBf16) ||
      (!bf16 && x.element_type() != ffi::F32)) {
    return ffi::Error::InvalidArgument("jl_packed_matmul: x's dtype does not match weight " +
                                       std::to_string(i) + " (f32 weights take f32 x, bf16 "
                                       "weights bf16 x; int8 weights the int8 target)");
  }
  const int64_t m = dims[0];
  if (m == 0) return ffi::Error::Success();
  const void* xd = x.untyped_data();
  float* yd = y->typed_data();
  if (w->backend == kAvx512 && w->dtype == kF32) {
    const auto* xf = static_cast<const float*>(xd);
    const auto* wf = static_cast<const float*>(w->parts[0].buf);
    RunPanels(pool, *w, [&](int64_t p0, int64_t p1) {
      jaxlearn::avx512::F32Panels(xf, m, w->k, w->n, wf, p0, p1, yd);
    });
    return ffi::Error::Success();
  }
  if (w->backend == kAvx512) {
    const auto* xb = static_cast<const uint16_t*>(xd);
    const auto* wb = static_cast<const uint16_t*>(w->parts[0].buf);
    const bool amx = jaxlearn::amx::AmxReady(false) && jaxlearn::amx::AmxFits(w->k, false);
    RunPanels(pool, *w, [&](int64_t p0, int64_t p1) {
      if (amx) {
        jaxlearn::amx::Bf16Panels(xb, m, w->k, w->n, wb, p0, p1, yd);
      } else {
        jaxlearn::avx512::Bf16Panels(xb, m, w->k, w->n, wb, p0, p1, yd);
      }
    });
    return ffi::Error::Success();
  }
  const int64_t parts = static_cast<int64_t>(w->parts.size());
  jaxlearn::PoolFor(pool, parts, parts - 1,
                    [&](int64_t p) { RunPart(*w, w->parts[p], xd, m, yd); });
  return ffi::Error::Success();
}

ffi::Error PackedInt8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> xq,
                                ffi::Buffer<ffi::F32> sx, ffi::Buffer<ffi::S32> id,
                                ffi::ResultBuffer<ffi::F32> y) {
  const int32_t i = id.typed_data()[0];
  ffi::Error error = ffi::Error::Success();
  Weight* w = Lookup(i, "jl_packed_int8_matmul", &error);
  if (w == nullptr) return error;
  if (w->dtype != kInt8) {
    return ffi::Error::InvalidArgument("jl_packed_int8_matmul: weight " + std::to_string(i) +
                                       " is not int8 (the float target takes it)");
  }
  auto dims = xq.dimensions();
  if (dims.size() != 2 || dims[1] != w->k || dims[0] > INT32_MAX ||
      static_cast<int64_t>(sx.element_count()) != dims[0]) {
    return ffi::Error::InvalidArgument("jl_packed_int8_matmul: xq must be [rows, " +
                                       std::to_string(w->k) + "] with one scale per row, for "
                                       "weight " + std::to_string(i));
  }
  const int64_t m = dims[0];
  if (m == 0) return ffi::Error::Success();
  const int64_t parts = static_cast<int64_t>(w->parts.size());
  const uint8_t* xd = xq.typed_data();
  const float* sd = sx.typed_data();
  float* yd = y->typed_data();
  if (w->backend == kAvx512) {
    const auto* wq = static_cast<const int8_t*>(w->parts[0].buf);
    const bool amx = jaxlearn::amx::AmxReady(true) && jaxlearn::amx::AmxFits(w->k, true);
    RunPanels(pool, *w, [&](int64_t p0, int64_t p1) {
      if (amx) {
        jaxlearn::amx::Int8Panels(xd, sd, m, w->k, w->n, wq, w->col_off.data(),
                                  w->scale.data(), p0, p1, yd);
      } else {
        jaxlearn::avx512::Int8Panels(xd, sd, m, w->k, w->n, wq, w->col_off.data(),
                                     w->scale.data(), p0, p1, yd);
      }
    });
    return ffi::Error::Success();
  }
  jaxlearn::PoolFor(pool, parts, parts - 1,
                    [&](int64_t p) { RunPartInt8(*w, w->parts[p], xd, sd, m, yd); });
  return ffi::Error::Success();
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  promise.SetError(std::move(error));
  return ffi::Future(promise);
}

// Rank-3 operands ([batch, ...] each, the same batch): one GEMM per batch entry, the
// entries split into `parts` contiguous ranges, each a pool task (attention's products).
ffi::Future SgemmBatched(ffi::ThreadPool& pool, const float* a0, const float* b0, float* cd,
                         int64_t batch, int64_t m, int64_t n, int64_t k, MklInt lda, MklInt ldb,
                         int ta, int tb, int64_t a_step, int64_t b_step, int32_t parts) {
  ffi::Promise done;
  ffi::Future future(done);
  const int64_t tasks = std::min<int64_t>(std::max<int32_t>(parts, 1), batch);
  const int64_t per = (batch + tasks - 1) / tasks;
  const int64_t blocks = (batch + per - 1) / per;
  ffi::CountDownPromise left(done, blocks);
  for (int64_t i = 0; i < blocks; ++i) {
    pool.Schedule([=]() mutable {
      for (int64_t e = i * per; e < std::min(batch, (i + 1) * per); ++e) {
        mkl.sgemm(kRowMajor, ta, tb, m, n, k, 1.0f, a0 + e * a_step, lda, b0 + e * b_step, ldb,
                  0.0f, cd + e * m * n, n);
      }
      left.CountDown();
    });
  }
  return future;
}

// Asynchronous: the blocks are pool tasks and the call returns at once, so XLA's executor
// goes on with the program's other ready ops (norms, activations, the optimizer's
// elementwise work) while the GEMM runs; a synchronous call would hold the executor and
// leave a core idle after it, when the next ops run on one thread. With an addend d
// (2-D only, c aliased to it by the caller where XLA can): c = op(a) @ op(b) + d, the sum
// done by the GEMM itself (beta = 1) instead of another pass over c.
ffi::Future SgemmRun(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                     const float* d, ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b,
                     int32_t parts) {
  auto ad = a.dimensions(), bd = b.dimensions();
  const size_t r = ad.size();
  if (r < 2 || r > 3 || bd.size() != r || (r == 3 && ad[0] != bd[0]) ||
      (d != nullptr && r != 2)) {
    return Failed(ffi::Error::InvalidArgument(
        "jl_sgemm: a and b must be 2-D, or 3-D with the same leading (batch) dimension "
        "(2-D with an addend)"));
  }
  const int64_t batch = r == 3 ? ad[0] : 1, ar = ad[r - 2], ac = ad[r - 1];
  const int64_t br = bd[r - 2], bc = bd[r - 1];
  const int64_t m = trans_a ? ac : ar, k = trans_a ? ar : ac;
  const int64_t n = trans_b ? br : bc, kb = trans_b ? bc : br;
  if (k != kb || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    return Failed(ffi::Error::InvalidArgument(
        "jl_sgemm: op(a) is [" + std::to_string(m) + ", " + std::to_string(k) +
        "] but op(b) has " + std::to_string(kb) + " rows"));
  }
  float* cd = c->typed_data();
  if (batch == 0 || m == 0 || n == 0 || k == 0) {
    if (d == nullptr) {
      std::fill(cd, cd + batch * m * n, 0.0f);
    } else if (d != cd) {
      std::copy(d, d + m * n, cd);
    }
    ffi::Promise done;
    done.SetAvailable();
    return ffi::Future(done);
  }
  const float *a0 = a.typed_data(), *b0 = b.typed_data();
  const MklInt lda = static_cast<MklInt>(ac), ldb = static_cast<MklInt>(bc);
  const int ta = trans_a ? kTrans : kNoTrans, tb = trans_b ? kTrans : kNoTrans;
  if (batch > 1) {  // One entry: the 2-D split below, over its rows or columns.
    return SgemmBatched(pool, a0, b0, cd, batch, m, n, k, lda, ldb, ta, tb, ar * ac, br * bc,
                        parts);
  }
  ffi::Promise done;
  ffi::Future future(done);
  // Blocks of the longer side of c, in multiples of 16 (one AVX-512 register of floats).
  const bool by_rows = m >= n;
  const int64_t side = by_rows ? m : n, p = std::max<int32_t>(parts, 1);
  const int64_t per = ((side + p - 1) / p + 15) / 16 * 16;
  const int64_t blocks = (side + per - 1) / per;
  const float beta = d == nullptr ? 0.0f : 1.0f;
  const bool copy = d != nullptr && d != cd;  // XLA did not alias c to d.
  ffi::CountDownPromise left(done, blocks);
  for (int64_t i = 0; i < blocks; ++i) {
    pool.Schedule([=]() mutable {
      const int64_t s0 = i * per, len = std::min(per, side - s0);
      if (by_rows) {  // Rows s0.. of op(a) and of c.
        if (copy) std::copy(d + s0 * n, d + (s0 + len) * n, cd + s0 * n);
        const float* as = trans_a ? a0 + s0 : a0 + s0 * lda;
        mkl.sgemm(kRowMajor, ta, tb, len, n, k, 1.0f, as, lda, b0, ldb, beta, cd + s0 * n, n);
      } else {  // Columns s0.. of op(b) and of c.
        if (copy) {
          for (int64_t row = 0; row < m; ++row) {
            std::copy(d + row * n + s0, d + row * n + s0 + len, cd + row * n + s0);
          }
        }
        const float* bs = trans_b ? b0 + s0 * ldb : b0 + s0;
        mkl.sgemm(kRowMajor, ta, tb, m, len, k, 1.0f, a0, lda, bs, ldb, beta, cd + s0, n);
      }
      left.CountDown();
    });
  }
  return future;
}

ffi::Future SgemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                      ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b,
                      int32_t parts) {
  return SgemmRun(pool, a, b, nullptr, c, trans_a, trans_b, parts);
}

ffi::Future SgemmAddImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a,
                         ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> d,
                         ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b,
                         int32_t parts) {
  if (d.element_count() != c->element_count()) {
    return Failed(ffi::Error::InvalidArgument("jl_sgemm_add: the addend is not c's shape"));
  }
  return SgemmRun(pool, a, b, d.typed_data(), c, trans_a, trans_b, parts);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlSgemm, SgemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b")
                                  .Attr<int32_t>("parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlSgemmAdd, SgemmAddImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b")
                                  .Attr<int32_t>("parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlPackedInt8Matmul, PackedInt8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" {

// Opens oneMKL at `path` (libmkl_rt), sequential. 0 on success; else a negative code and
// `err` (err_len bytes) holds why.
int jl_init(const char* path, char* err, int err_len) {
  if (mkl.s_compute != nullptr) return 0;
  void* lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  auto fail = [&](const std::string& why) {
    std::snprintf(err, err_len, "%s", why.c_str());
    return -1;
  };
  if (lib == nullptr) return fail(std::string("dlopen: ") + dlerror());
  auto interface = reinterpret_cast<int (*)(int)>(dlsym(lib, "MKL_Set_Interface_Layer"));
  auto layer = reinterpret_cast<int (*)(int)>(dlsym(lib, "MKL_Set_Threading_Layer"));
  if (interface == nullptr || layer == nullptr) return fail("not an MKL runtime (libmkl_rt)");
  interface(kInterfaceLp64);
  layer(kThreadingSequential);
  Mkl m;
  m.s_size = reinterpret_cast<PackSizeFn>(dlsym(lib, "cblas_sgemm_pack_get_size"));
  m.s_pack = reinterpret_cast<SPackFn>(dlsym(lib, "cblas_sgemm_pack"));
  m.s_compute = reinterpret_cast<SComputeFn>(dlsym(lib, "cblas_sgemm_compute"));
  m.b_size = reinterpret_cast<PackSizeFn>(dlsym(lib, "cblas_gemm_bf16bf16f32_pack_get_size"));
  m.b_pack = reinterpret_cast<BPackFn>(dlsym(lib, "cblas_gemm_bf16bf16f32_pack"));
  m.b_compute = reinterpret_cast<BComputeFn>(dlsym(lib, "cblas_gemm_bf16bf16f32_compute"));
  m.i_size = reinterpret_cast<PackSizeFn>(dlsym(lib, "cblas_gemm_s8u8s32_pack_get_size"));
  m.i_pack = reinterpret_cast<IPackFn>(dlsym(lib, "cblas_gemm_s8u8s32_pack"));
  m.i_compute = reinterpret_cast<IComputeFn>(dlsym(lib, "cblas_gemm_s8u8s32_compute"));
  m.sgemm = reinterpret_cast<SgemmFn>(dlsym(lib, "cblas_sgemm"));
  if (!m.sgemm || !m.s_size || !m.s_pack || !m.s_compute || !m.b_size || !m.b_pack ||
      !m.b_compute || !m.i_size || !m.i_pack || !m.i_compute) {
    return fail("the MKL library lacks the (packed) GEMM functions");
  }
  mkl = m;
  return 0;
}

// Packs w ([k, n] row major; f32 for dtype 0, bf16 bits for dtype 1, int8 for dtype 2
// with per-column `scale` [n]). backend kMklBackend: `parts` column blocks of multiples of
// 64 columns for oneMKL; kAvx512 (on a host with the instructions, jl_avx512_ok): the
// panels of avx512_gemm.h in one block.
// Returns its id (>= 0), or -1 (not initialised, unsupported, out of ids or memory).
int jl_pack(const void* w, int64_t k, int64_t n, int dtype, int parts, const float* scale,
            int backend) {
  namespace a5 = jaxlearn::avx512;
  if (mkl.s_compute == nullptr || k <= 0 || n <= 0 || k > INT32_MAX || n > INT32_MAX ||
      parts < 1 || dtype < kF32 || dtype > kInt8 || (dtype == kInt8 && scale == nullptr) ||
      (backend != kMklBackend && backend != kAvx512) ||
      (backend == kAvx512 && !a5::HostRuns(KindOf(dtype)))) {
    return -1;
  }
  auto weight = std::make_unique<Weight>();
  weight->k = k;
  weight->n = n;
  weight->dtype = dtype;
  weight->backend = backend;
  if (dtype == kInt8) {
    const int8_t* q = static_cast<const int8_t*>(w);
    const int64_t width = backend == kAvx512 ? a5::Panels(n) * a5::kPanel : n;
    weight->scale.assign(static_cast<size_t>(width), 0.0f);
    std::copy(scale, scale + n, weight->scale.begin());
    weight->col_off.assign(static_cast<size_t>(width), 0);
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t j = 0; j < n; ++j) weight->col_off[j] -= 128 * q[r * n + j];
    }
  }
  if (backend == kAvx512) {
    const size_t bytes = static_cast<size_t>(a5::PackedBytes(k, n, KindOf(dtype)));
    void* buf = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) return -1;
    weight->parts.push_back({0, n, buf, bytes});
    if (dtype == kF32) {
      a5::PackF32(static_cast<const float*>(w), k, n, static_cast<float*>(buf));
    } else if (dtype == kBf16) {
      a5::PackBf16(static_cast<const uint16_t*>(w), k, n, static_cast<uint16_t*>(buf));
    } else {
      a5::PackInt8(static_cast<const int8_t*>(w), k, n, static_cast<int8_t*>(buf));
    }
  }
  const int64_t block = 64;
  int64_t per = (n + parts - 1) / parts;
  per = (per + block - 1) / block * block;
  for (int64_t n0 = 0; backend == kMklBackend && n0 < n; n0 += per) {
    const int64_t nc = n0 + per <= n ? per : n - n0;
    const size_t bytes = dtype == kF32    ? mkl.s_size(kBMatrix, 1, nc, k)
                         : dtype == kBf16 ? mkl.b_size(kBMatrix, 1, nc, k)
                                          : mkl.i_size(kBMatrix, 1, nc, k);
    void* buf = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) return -1;
    weight->parts.push_back({n0, nc, buf, bytes});
    if (dtype == kF32) {
      mkl.s_pack(kRowMajor, kBMatrix, kNoTrans, 1, nc, k, 1.0f, static_cast<const float*>(w) + n0,
                 n, static_cast<float*>(buf));
    } else if (dtype == kBf16) {
      mkl.b_pack(kRowMajor, kBMatrix, kNoTrans, 1, nc, k, static_cast<const uint16_t*>(w) + n0,
                 n, static_cast<uint16_t*>(buf));
    } else {
      mkl.i_pack(kRowMajor, kBMatrix, kNoTrans, 1, nc, k, static_cast<const int8_t*>(w) + n0, n,
                 buf);
    }
  }
  int id = -1;
  {
    std::lock_guard<std::mutex> lock(free_mu);
    if (!free_ids.empty()) {
      id = free_ids.back();
      free_ids.pop_back();
    }
  }
  if (id < 0) id = next_id.fetch_add(1);
  if (id >= kMaxWeights) return -1;
  table[id].store(weight.release(), std::memory_order_release);
  return id;
}

// Whether this CPU runs the avx512 backend for dtype (kF32: AVX512F, kBf16: AVX512_BF16,
// kInt8: VNNI).
int jl_avx512_ok(int dtype) {
  return dtype >= kF32 && dtype <= kInt8 && jaxlearn::avx512::HostRuns(KindOf(dtype));
}

// Whether matmuls of dtype (kBf16, kInt8) on the avx512 backend's panels run AMX tiles
// here (amx_gemm.h; for weights whose k fills whole tile steps).
int jl_amx_ok(int dtype) {
  return (dtype == kBf16 || dtype == kInt8) && jaxlearn::amx::AmxReady(dtype == kInt8);
}

// Frees weight `id` (no program may be running with it).
void jl_free(int id) {
  if (id < 0 || id >= kMaxWeights) return;
  Weight* w = table[id].exchange(nullptr);
  if (w == nullptr) return;
  delete w;
  std::lock_guard<std::mutex> lock(free_mu);
  free_ids.push_back(id);
}

// Bytes held by weight `id` (0 when there is none).
int64_t jl_bytes(int id) {
  if (id < 0 || id >= kMaxWeights) return 0;
  Weight* w = table[id].load();
  if (w == nullptr) return 0;
  int64_t total = 0;
  for (auto& p : w->parts) total += static_cast<int64_t>(p.bytes);
  return total;
}

}  // extern "C"

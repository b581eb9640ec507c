// XLA FFI handler: y [M, N] f32 = x [M, K] bf16 @ w bf16, w stored [K, N] or (w_transposed)
// [N, K], through oneDNN's matmul primitive. Built and loaded by onednn.py; see its
// docstring for why (XLA:CPU's small-M bf16 dots) and when it is used.
//
// One primitive per (M, K, N, w_transposed), created on first use and kept: oneDNN
// primitives may execute concurrently from several threads; each thread has its own stream.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Key = std::tuple<int64_t, int64_t, int64_t, bool>;

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct Matmul {
  dnnl::memory::desc x, w, y;
  dnnl::matmul primitive;
};

const Matmul& GetMatmul(int64_t m, int64_t k, int64_t n, bool w_transposed) {
  static std::mutex mu;
  static std::map<Key, std::unique_ptr<Matmul>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[Key(m, k, n, w_transposed)];
  if (!slot) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    dnnl::memory::desc x({m, k}, dt::bf16, tag::ab);
    dnnl::memory::desc w({k, n}, dt::bf16, w_transposed ? tag::ba : tag::ab);
    dnnl::memory::desc y({m, n}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd(Engine(), x, w, y);
    slot = std::make_unique<Matmul>(Matmul{x, w, y, dnnl::matmul(pd)});
  }
  return *slot;
}

ffi::Error MatmulImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::ResultBuffer<ffi::F32> y, bool w_transposed) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlearn_onednn_matmul: x and w must be 2-D");
  }
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = w_transposed ? wd[0] : wd[1];
  if ((w_transposed ? wd[1] : wd[0]) != k) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxlearn_onednn_matmul: x's last dim does not match w's contracted dim");
  }
  try {
    const Matmul& mm = GetMatmul(m, k, n, w_transposed);
    thread_local dnnl::stream stream(Engine());
    dnnl::memory xm(mm.x, Engine(), x.untyped_data());
    dnnl::memory wm(mm.w, Engine(), w.untyped_data());
    dnnl::memory ym(mm.y, Engine(), y->untyped_data());
    mm.primitive.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jaxlearn_onednn_matmul: oneDNN: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlearnOnednnMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("w_transposed"));

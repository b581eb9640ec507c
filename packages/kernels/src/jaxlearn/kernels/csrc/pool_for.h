// PoolFor: fn(i) for i in [0, total) on XLA's intra-op thread pool, the FFI kernels'
// one way of running work in parallel.
//
// `helpers` pool tasks are scheduled and the calling thread claims work too, so a call
// never waits on a pool whose threads are busy (two such calls on a two-thread pool cannot
// deadlock). A pool task that starts after the call returned finds nothing to claim and
// touches only the shared counters, never `fn` or what it refers to: a claimed index
// (< total) means the call is still waiting for it.
//
// Lingering (off by default): a serving step hands work to the pool about five times per
// layer (each packed GEMM and attention call), with one-core XLA ops in between. A pool
// thread that went to sleep takes a wake-up (a futex, a few us) at each hand-off, and the
// caller another when it waits for the last block. With JAXLEARN_POOL_SPIN_US=N, a helper
// whose work ran out spins (yielding the core at each turn) for up to N us for the next
// PoolFor job of this library and joins it, and a caller spins as long for its last blocks
// before it sleeps. The spin counts as CPU time, as OpenMP runtimes' waiting threads do.
// A lingering helper holds one of XLA's pool threads, which XLA's own multi-threaded ops
// then wait for. Measured (packages/kernels/README.md): bf16 serving faster, int8 serving
// at 32 in flight slower, hence off unless asked for: the environment variable sets the
// process's start value, `jl_set_pool_spin_us` (`kernels.set_pool_spin_us`) changes it.
//
// Each FFI library here is one translation unit that includes this header once, so the
// two extern "C" functions at the end are defined once per library.
#ifndef JAXLEARN_KERNELS_POOL_FOR_H_
#define JAXLEARN_KERNELS_POOL_FOR_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxlearn {
namespace pool_for {

constexpr int64_t kSpinUs = 0;  // Default: off (module comment).

struct JobBase {
  virtual ~JobBase() = default;
  virtual void Work() = 0;
};

// The latest job, for lingering helpers: `generation` changes when one is published.
struct Mailbox {
  std::mutex mu;
  std::shared_ptr<JobBase> job;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> lingering{0};
};
inline Mailbox& mailbox() {
  static Mailbox m;
  return m;
}

// The spin in us: JAXLEARN_POOL_SPIN_US at the first use, then `jl_set_pool_spin_us`.
inline std::atomic<int64_t>& SpinUs() {
  static std::atomic<int64_t> us{[] {
    const char* env = std::getenv("JAXLEARN_POOL_SPIN_US");
    return env != nullptr ? static_cast<int64_t>(std::atoll(env)) : kSpinUs;
  }()};
  return us;
}
inline std::chrono::nanoseconds SpinTime() {
  return std::chrono::microseconds(SpinUs().load(std::memory_order_relaxed));
}

// Spins until done() or SpinTime() has passed; returns done(). Each turn yields the core,
// so a server's Python threads (HTTP, detokenization) run when they are runnable.
template <typename Done>
bool Spin(const Done& done) {
  if (SpinTime().count() <= 0) return done();  // Off: no clock read on the call's path.
  const auto end = std::chrono::steady_clock::now() + SpinTime();
  while (!done()) {
    if (std::chrono::steady_clock::now() >= end) return done();
    std::this_thread::yield();
  }
  return true;
}

// A helper whose work ran out joins the jobs published while it spins (module comment).
inline void Linger() {
  if (SpinTime().count() <= 0) return;
  Mailbox& m = mailbox();
  m.lingering.fetch_add(1);
  uint64_t seen = m.generation.load(std::memory_order_acquire);
  while (Spin([&] { return m.generation.load(std::memory_order_acquire) != seen; })) {
    std::shared_ptr<JobBase> job;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      job = m.job;
      seen = m.generation.load(std::memory_order_acquire);
    }
    m.lingering.fetch_sub(1);
    job->Work();
    m.lingering.fetch_add(1);
  }
  m.lingering.fetch_sub(1);
}

}  // namespace pool_for

template <typename Fn>
void PoolFor(xla::ffi::ThreadPool& pool, int64_t total, int64_t helpers, const Fn& fn) {
  struct Job : pool_for::JobBase {
    const Fn* fn;
    int64_t total;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;

    void Work() override {
      for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
        (*fn)(i);
        if (done.fetch_add(1) + 1 == total) {
          std::lock_guard<std::mutex> lock(mu);
          cv.notify_all();
        }
      }
    }
  };
  if (total <= 0) return;
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->total = total;
  pool_for::Mailbox& m = pool_for::mailbox();
  if (helpers > 0 && pool_for::SpinTime().count() > 0) {
    {
      std::lock_guard<std::mutex> lock(m.mu);
      m.job = job;
      m.generation.fetch_add(1, std::memory_order_release);
    }
    helpers -= m.lingering.load();  // They join at once; the caller covers a late one.
  }
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([job] {
      job->Work();
      pool_for::Linger();
    });
  }
  job->Work();
  if (pool_for::Spin([&] { return job->done.load() == total; })) return;
  std::unique_lock<std::mutex> lock(job->mu);
  job->cv.wait(lock, [&] { return job->done.load() == total; });
}

}  // namespace jaxlearn

// This library's spin (module comment); negative values count as 0 (off).
extern "C" void jl_set_pool_spin_us(int64_t us) {
  jaxlearn::pool_for::SpinUs().store(us > 0 ? us : 0, std::memory_order_relaxed);
}
extern "C" int64_t jl_pool_spin_us() {
  return jaxlearn::pool_for::SpinUs().load(std::memory_order_relaxed);
}

#endif  // JAXLEARN_KERNELS_POOL_FOR_H_

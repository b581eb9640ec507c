// PoolFor: fn(i) for i in [0, total) on XLA's intra-op thread pool, the FFI kernels'
// one way of running work in parallel.
//
// `helpers` pool tasks are scheduled and the calling thread claims work too, so a call
// never waits on a pool whose threads are busy (two such calls on a two-thread pool cannot
// deadlock). A pool task that starts after the call returned finds nothing to claim and
// touches only the shared counters, never `fn` or what it refers to: a claimed index
// (< total) means the call is still waiting for it.
#ifndef JAXLEARN_KERNELS_POOL_FOR_H_
#define JAXLEARN_KERNELS_POOL_FOR_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxlearn {

template <typename Fn>
void PoolFor(xla::ffi::ThreadPool& pool, int64_t total, int64_t helpers, const Fn& fn) {
  struct Job {
    const Fn* fn;
    int64_t total;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;

    void Work() {
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
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->Work(); });
  job->Work();
  std::unique_lock<std::mutex> lock(job->mu);
  job->cv.wait(lock, [&] { return job->done.load() == total; });
}

}  // namespace jaxlearn

#endif  // JAXLEARN_KERNELS_POOL_FOR_H_

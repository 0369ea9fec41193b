// Shared by the native CPU kernels: items spread over the calling thread and XLA's intra-op pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxcb {

// Runs fn(item) for every item in [0, total). Items are taken from an atomic counter by the caller and
// by up to pool.num_threads() - 1 pool tasks (none unless `helpers_pay`: waking a pool thread costs tens
// of microseconds); a task that starts late finds nothing left, and the caller waits only for items
// that are being run, never for a task that has not started.
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t total, bool helpers_pay, F fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, total, fn]() {
    int64_t finished = 0;
    for (int64_t item; (item = shared->next.fetch_add(1)) < total;) {
      fn(item);
      ++finished;
    }
    shared->done.fetch_add(finished);
  };
  const int64_t helpers = helpers_pay ? std::min<int64_t>(pool.num_threads(), total) - 1 : 0;
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (shared->done.load() < total) std::this_thread::yield();
}

}  // namespace jaxcb

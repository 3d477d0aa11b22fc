// The host side of the mailbox (kernels/host_mailbox/__init__.py has the words and the GPU's
// side): a worker thread's polling loop, shared by the host expert kernel's worker
// (fused_moe/host_experts.cpp) and the copy engine's (gather_copy/copy_engine.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <immintrin.h>

namespace mailbox {

constexpr int kRequest = 0, kCall = 1, kDone = 8, kBadCall = 16;  // int64 words of the box

// Poll `box` until `stop`: each new request's number goes to `handle(request)`, which publishes
// it done (kDone) itself, at once or once its work lands. Spins (with pause) while requests
// come, and sleeps between polls after 20 ms without any (50 us, then 1 ms after a second), so
// an idle engine does not keep a core busy.
template <typename Handle>
void poll(int64_t* box, const std::atomic<bool>& stop, Handle handle) {
  int64_t seen = __atomic_load_n(&box[kDone], __ATOMIC_ACQUIRE);
  auto last = std::chrono::steady_clock::now();
  while (!stop.load(std::memory_order_relaxed)) {
    const int64_t posted = __atomic_load_n(&box[kRequest], __ATOMIC_ACQUIRE);
    if (posted == seen) {
      const auto idle = std::chrono::steady_clock::now() - last;
      if (idle > std::chrono::seconds(1))
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      else if (idle > std::chrono::milliseconds(20))
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      else
        _mm_pause();
      continue;
    }
    handle(posted);
    seen = posted;
    last = std::chrono::steady_clock::now();
  }
}

}  // namespace mailbox

// The copy engine's worker (copy_engine.py): expert rows from pinned host banks into device
// slots by DMA, on a plan the GPU decided, so no SM spends a cycle on the copy and the compute
// beside it keeps its speed (an SM gather over PCIe slows a kernel beside it several-fold:
// RESULTS copy/beside-compute).
//
// GPU kernels post a request in a pinned mailbox (kernels/host_mailbox: [0] REQUEST, the request's
// sequence number; [1] CALL, here the MoE layer whose host banks the plan reads), the posting
// kernel having copied the plan into pinned memory first: int32 [1 + 2P], the row count, then P
// source rows (experts of the layer), then P destination rows (slots). This thread polls the
// mailbox, enqueues one host-to-device copy per planned row and bank on a CUDA stream of its own,
// then a write of the request's number into the mailbox's DONE word ([8]) behind them
// (cuStreamWriteValue64: it lands once every copy before it has), which the GPU's wait kernel reads
// (where the driver has no stream memory operations, the worker waits for the copies and writes the
// word itself). Requests come one at a time (the GPU posts the next after it has seen the last
// done). A failed driver call sets [16] to its error code and still publishes the request done, so
// the GPU never hangs; the Python side checks that word (copy_engine.py: `failed`).
//
// The CUDA driver is reached through dlopen/dlsym of libcuda.so.1 (already loaded by torch):
// this file needs no CUDA headers or libraries to build.

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>

#include "../host_mailbox/poll.h"

namespace {

using CUresult = int;
using CUcontext = void*;
using CUstream = void*;
using CUdeviceptr = unsigned long long;
using CtxGetCurrent = CUresult (*)(CUcontext*);
using CtxSetCurrent = CUresult (*)(CUcontext);
using MemcpyHtoDAsync = CUresult (*)(CUdeviceptr, const void*, size_t, CUstream);
using StreamWriteValue64 = CUresult (*)(CUstream, CUdeviceptr, uint64_t, unsigned int);
using StreamSynchronize = CUresult (*)(CUstream);

constexpr int kError = mailbox::kBadCall;  // here: a failed request's error code

struct Driver {
  CtxGetCurrent ctx_get = nullptr;
  CtxSetCurrent ctx_set = nullptr;
  MemcpyHtoDAsync memcpy = nullptr;
  StreamWriteValue64 write_value = nullptr;
  StreamSynchronize synchronize = nullptr;
};

template <typename F>
F symbol(void* lib, const char* name, const char* fallback) {
  void* f = dlsym(lib, name);
  if (f == nullptr && fallback != nullptr) f = dlsym(lib, fallback);
  return reinterpret_cast<F>(f);
}

// 0, or a message for what is missing.
const char* load_driver(Driver* d) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) return "libcuda.so.1 could not be opened";
  d->ctx_get = symbol<CtxGetCurrent>(lib, "cuCtxGetCurrent", nullptr);
  d->ctx_set = symbol<CtxSetCurrent>(lib, "cuCtxSetCurrent", nullptr);
  d->memcpy = symbol<MemcpyHtoDAsync>(lib, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync");
  d->write_value = symbol<StreamWriteValue64>(lib, "cuStreamWriteValue64_v2", "cuStreamWriteValue64");
  d->synchronize = symbol<StreamSynchronize>(lib, "cuStreamSynchronize", nullptr);
  if (!d->ctx_get || !d->ctx_set || !d->memcpy || !d->write_value || !d->synchronize)
    return "a CUDA driver entry point is missing";
  return nullptr;
}

}  // namespace

extern "C" {

// What the worker copies; copy_engine.py fills it (the field order is the contract). Pointers
// stay valid while the worker runs: copy_engine.py holds the tensors.
struct MoECopyTable {
  int64_t* box;               // the mailbox, pinned, kernels/host_mailbox's words
  const int32_t* plan;        // pinned [1 + 2 * capacity]: count, sources, destinations
  int64_t capacity;           // P
  int64_t layers, banks;      // host banks: `banks` per MoE layer
  const uint64_t* host;       // [layers * banks] base addresses of the host banks (pinned)
  const uint64_t* slots;      // [banks] base addresses of the slot banks (device)
  const int64_t* row_bytes;   // [banks] bytes of one row (one expert) of each bank
  void* stream;               // CUstream the copies and the done write go on
};

}  // extern "C"

namespace {

struct CopyWorker {
  MoECopyTable table;
  Driver driver;
  CUcontext context = nullptr;
  std::atomic<bool> stop{false};
  std::thread thread;
};

// One request: every planned row of every bank, then the done write behind them.
void copy_request(CopyWorker* w, int64_t request) {
  const MoECopyTable& t = w->table;
  const int64_t layer = __atomic_load_n(&t.box[mailbox::kCall], __ATOMIC_ACQUIRE);
  const int32_t count = t.plan[0];
  CUresult error = 0;
  if (layer < 0 || layer >= t.layers || count < 0 || count > t.capacity) {
    error = -1;
  } else {
    const int32_t* src = t.plan + 1;
    const int32_t* dst = t.plan + 1 + t.capacity;
    for (int32_t i = 0; i < count && error == 0; ++i) {
      for (int64_t b = 0; b < t.banks && error == 0; ++b) {
        const int64_t bytes = t.row_bytes[b];
        const char* from = reinterpret_cast<const char*>(t.host[layer * t.banks + b]) + src[i] * bytes;
        error = w->driver.memcpy(t.slots[b] + static_cast<CUdeviceptr>(dst[i]) * bytes, from, bytes, t.stream);
      }
    }
  }
  if (error != 0) __atomic_store_n(&t.box[kError], static_cast<int64_t>(error), __ATOMIC_RELEASE);
  const CUdeviceptr done = reinterpret_cast<CUdeviceptr>(&t.box[mailbox::kDone]);
  if (w->driver.write_value(t.stream, done, static_cast<uint64_t>(request), 0) != 0) {
    // no stream memory operations here: wait for the copies, then publish from this thread
    const CUresult synced = w->driver.synchronize(t.stream);
    if (synced != 0 && error == 0) __atomic_store_n(&t.box[kError], static_cast<int64_t>(synced), __ATOMIC_RELEASE);
    __atomic_store_n(&t.box[mailbox::kDone], request, __ATOMIC_RELEASE);
  }
}

void worker_loop(CopyWorker* w) {
  w->driver.ctx_set(w->context);
  mailbox::poll(w->table.box, w->stop, [w](int64_t request) { copy_request(w, request); });
}

}  // namespace

extern "C" {

// Start a worker over `table` in the calling thread's CUDA context; null on failure, with a
// message in `error` (`error_len` bytes).
void* moe_copy_engine_start(const MoECopyTable* table, char* error, int64_t error_len) {
  auto* w = new CopyWorker{};
  w->table = *table;
  const char* missing = load_driver(&w->driver);
  if (missing == nullptr && (w->driver.ctx_get(&w->context) != 0 || w->context == nullptr))
    missing = "no current CUDA context in the starting thread";
  if (missing != nullptr) {
    std::strncpy(error, missing, static_cast<size_t>(error_len) - 1);
    error[error_len - 1] = '\0';
    delete w;
    return nullptr;
  }
  w->thread = std::thread(worker_loop, w);
  return w;
}

// Stop and join a worker (after its last request).
void moe_copy_engine_stop(void* handle) {
  auto* w = static_cast<CopyWorker*>(handle);
  w->stop.store(true);
  w->thread.join();
  delete w;
}

}  // extern "C"

#include "plugin/backend/nccl/nccl_backend.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "plugin/backend/nccl/module_loader.h"
#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/rendezvous/rendezvous.h"

namespace sfsync {

namespace {

constexpr const char* kUniqueIdKey = "nccl_unique_id";
constexpr const char* kByeKey = "nccl_bye/";

class NcclWork : public Work {
 public:
  NcclWork(const sfn_api& api, sfn_work* work, int64_t timeoutMs)
      : api_(api), work_(work), timeoutMs_(timeoutMs) {}
  ~NcclWork() override {
    if (work_) {
      sfn_error err;
      api_.work_wait(work_, timeoutMs_, &err);  // frees it; errors were someone else's to see
    }
  }
  void wait() override {
    sfn_work* w = work_;
    work_ = nullptr;
    if (!w) return;
    sfn_error err;
    const int32_t status = api_.work_wait(w, timeoutMs_, &err);
    if (status != SF_OK) throw Error(status, err.message);
  }

 private:
  const sfn_api& api_;
  sfn_work* work_;
  int64_t timeoutMs_;
};

}  // namespace

std::unique_ptr<Work> NcclBackend::startScale(void* data, int64_t numel, sf_dtype dtype, double factor) {
  if (api_.struct_size < offsetof(sfn_api, scale_start) + sizeof api_.scale_start ||
      !api_.scale_start) {
    fail(SF_ERR_UNSUPPORTED, "nccl: the loaded libsfsync_nccl.so predates weighted windows "
                             "(no scale_start): install the module of this libsfsync.so");
  }
  sfn_work* work = nullptr;
  sfn_error err;
  check(api_.scale_start(comm_, data, numel, dtype, factor, &work, &err), err);
  return std::make_unique<NcclWork>(api_, work, opts_.timeout_ms);
}

void checkNcclAvailable() {
  const sfn_api& api = ncclModule();
  sfn_error err;
  int32_t devices = 0, cudaVersion = 0, ncclVersion = 0;
  const int32_t status = api.probe(&devices, &cudaVersion, &ncclVersion, &err);
  if (status != SF_OK) fail(status, std::string("nccl: ") + err.message);
}

NcclBackend::NcclBackend(const sf_options& opts, std::shared_ptr<Rendezvous> rendezvous)
    : opts_(opts), rendezvous_(std::move(rendezvous)), api_(ncclModule()) {
  sfn_error err;
  int32_t cudaVersion = 0, ncclVersion = 0;
  check(api_.probe(&deviceCount_, &cudaVersion, &ncclVersion, &err), err);
}

NcclBackend::~NcclBackend() {
  if (comm_) api_.comm_free(comm_, teardown_ ? teardown_->remaining().count() : opts_.timeout_ms);
  if (device_) api_.device_close(device_);
}

void NcclBackend::check(int32_t status, const sfn_error& err) const {
  if (status != SF_OK) fail(status, std::string("nccl: ") + err.message);
}

sfn_device* NcclBackend::device() {
  if (device_) return device_;
  if (deviceIndex_ < 0) {
    if (opts_.local_rank < 0 || deviceCount_ <= 0) {
      fail(SF_ERR_INVALID_ARGUMENT, "nccl: local_rank = " + std::to_string(opts_.local_rank) +
                                        " with " + std::to_string(deviceCount_) + " visible GPU(s)");
    }
    deviceIndex_ = opts_.local_rank % deviceCount_;
    if (opts_.local_rank >= deviceCount_ && deviceCount_ > 1) {
      SF_LOG(kWarn, "nccl", "local_rank " << opts_.local_rank << " is beyond the " << deviceCount_
                                          << " visible GPUs: using GPU " << deviceIndex_
                                          << " (shared with local_rank " << deviceIndex_ << ")");
    }
  }
  sfn_error err;
  check(api_.device_open(deviceIndex_, &device_, &err), err);
  api_.set_host_stream(device_, hostStream_);
  return device_;
}

void NcclBackend::setHostStream(void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  hostStream_ = stream;
  if (device_) api_.set_host_stream(device_, stream);
}

void NcclBackend::adopt(void* ncclComm) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (comm_) {
    fail(SF_ERR_INVALID_STATE, "a communicator is already in use (adopt the host's communicator "
                               "before the first synchronization)");
  }
  int32_t world = 0, rank = 0, dev = 0;
  sfn_error err;
  check(api_.comm_query(ncclComm, &world, &rank, &dev, &err), err);
  if (world != opts_.world_size || rank != opts_.rank) {
    fail(SF_ERR_INVALID_ARGUMENT, "the adopted communicator has rank " + std::to_string(rank) +
                                      " of " + std::to_string(world) + ", but this context is rank " +
                                      std::to_string(opts_.rank) + " of world_size " +
                                      std::to_string(opts_.world_size));
  }
  if (device_ && dev != deviceIndex_) {
    fail(SF_ERR_INVALID_ARGUMENT, "the adopted communicator is on GPU " + std::to_string(dev) +
                                      ", but this context's gradients are on GPU " +
                                      std::to_string(deviceIndex_) +
                                      " (adopt before registering CUDA gradients, or set local_rank)");
  }
  deviceIndex_ = dev;
  adopted_ = ncclComm;
}

void NcclBackend::checkDeviceMemory(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  sfn_error err;
  check(api_.check_pointer(device(), p, bytes, &err), err);
}

void NcclBackend::connect() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (comm_) return;
  sfn_device* dev = device();
  sfn_error err;
  if (adopted_) {
    check(api_.comm_adopt(dev, adopted_, opts_.timeout_ms, &comm_, &err), err);
    return;
  }
  uint8_t id[SFN_UNIQUE_ID_BYTES];
  if (opts_.rank == 0) check(api_.unique_id(id, &err), err);
  if (opts_.world_size > 1) {
    // The unique id travels through the same rendezvous as Gloo's.
    store_ = rendezvous_->store();
    try {
      if (opts_.rank == 0) {
        store_->set(kUniqueIdKey, std::vector<char>(id, id + SFN_UNIQUE_ID_BYTES));
      } else {
        store_->wait({kUniqueIdKey}, std::chrono::milliseconds(opts_.timeout_ms));
        const std::vector<char> v = store_->get(kUniqueIdKey);
        if (v.size() != SFN_UNIQUE_ID_BYTES) {
          fail(SF_ERR_BACKEND, "nccl: the unique id in the rendezvous store has " +
                                   std::to_string(v.size()) + " bytes, not " +
                                   std::to_string(SFN_UNIQUE_ID_BYTES));
        }
        std::memcpy(id, v.data(), SFN_UNIQUE_ID_BYTES);
      }
    } catch (const std::exception& e) {
      const std::string m = e.what();
      const Error* own = dynamic_cast<const Error*>(&e);
      const bool timedOut = own ? own->status() == SF_ERR_TIMEOUT
                                : m.find("imeout") != std::string::npos ||
                                      m.find("imed out") != std::string::npos;
      fail(own && !timedOut ? own->status() : timedOut ? SF_ERR_TIMEOUT : SF_ERR_BACKEND,
           "nccl: rank " + std::to_string(opts_.rank) +
               (opts_.rank == 0 ? " could not publish" : " did not receive") +
               " the NCCL unique id through rendezvous '" + std::string(opts_.rendezvous) +
               "': " + m);
    }
  }
  check(api_.comm_init(dev, id, opts_.world_size, opts_.rank, opts_.timeout_ms, &comm_, &err), err);
}

std::unique_ptr<Work> NcclBackend::startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                                  ReduceSpec spec) {
  connect();
  sfn_work* work = nullptr;
  sfn_error err;
  check(api_.allreduce_start(comm_, data, numel, spec.scaledElems, dtype, spec.prescale,
                             spec.postscale, &work, &err),
        err);
  return std::make_unique<NcclWork>(api_, work, opts_.timeout_ms);
}

bool NcclBackend::movesOnlyUsed() const {
  return api_.struct_size >= offsetof(sfn_api, allgather_used_start) + sizeof api_.allgather_used_start &&
         api_.reduce_scatter_used_start && api_.allgather_used_start;
}

std::vector<int64_t> NcclBackend::paddedUsed(const ReduceSpec& spec, int64_t dataEnd) const {
  const std::vector<int64_t>& used = spec.segmentUsed;
  if (!movesOnlyUsed() || used.size() != size_t(opts_.world_size)) return {};
  std::vector<int64_t> clamped(used.size());
  int64_t padding = 0;
  for (size_t r = 0; r < used.size(); ++r) {
    clamped[r] = std::max<int64_t>(0, std::min(used[r], dataEnd));
    padding += dataEnd - clamped[r];
  }
  return padding * 16 > int64_t(used.size()) * dataEnd ? clamped : std::vector<int64_t>{};
}

bool NcclBackend::movesPadding(const ReduceSpec& spec, int64_t segmentElems) const {
  return paddedUsed(spec, spec.dataEnd(segmentElems)).empty();
}

std::unique_ptr<Work> NcclBackend::startReduceScatter(void* data, int64_t segmentElems,
                                                      sf_dtype dtype, ReduceSpec spec) {
  connect();
  sfn_work* work = nullptr;
  sfn_error err;
  // Segments with much padding (uneven shards): only their used elements
  // and the reserved tails travel.
  const int64_t dataEnd = spec.dataEnd(segmentElems);
  const std::vector<int64_t> used = paddedUsed(spec, dataEnd);
  if (!used.empty()) {
    check(api_.reduce_scatter_used_start(comm_, data, segmentElems, dataEnd, used.data(), dtype,
                                         spec.prescale, spec.postscale, &work, &err),
          err);
  } else {
    check(api_.reduce_scatter_start(comm_, data, segmentElems, dtype, spec.prescale,
                                    spec.postscale, &work, &err),
          err);
  }
  return std::make_unique<NcclWork>(api_, work, opts_.timeout_ms);
}

std::unique_ptr<Work> NcclBackend::startAllgather(void* data, int64_t segmentElems, sf_dtype dtype,
                                                  ReduceSpec spec) {
  connect();
  sfn_work* work = nullptr;
  sfn_error err;
  // A gather has no reserved tail to move: the used elements only.
  const std::vector<int64_t> used = paddedUsed(spec, spec.dataEnd(segmentElems));
  if (!used.empty()) {
    check(api_.allgather_used_start(comm_, data, segmentElems, used.data(), dtype, &work, &err), err);
  } else {
    check(api_.allgather_start(comm_, data, segmentElems, dtype, &work, &err), err);
  }
  return std::make_unique<NcclWork>(api_, work, opts_.timeout_ms);
}

void NcclBackend::allreduceMaxInt64(int64_t* data, int64_t n) {
  connect();
  sfn_error err;
  check(api_.allreduce_max_int64(comm_, data, n, opts_.timeout_ms, &err), err);
}

void NcclBackend::barrierQuietly() noexcept {
  // Bounded, errors ignored (the context is going away). An adopted
  // communicator stays the host's: nothing of ours to tear down.
  if (!comm_ || barrierDone_ || adopted_ || !store_ || opts_.world_size <= 1) return;
  barrierDone_ = true;
  teardown_ = std::make_unique<Deadline>(opts_.timeout_ms);
  try {
    store_->set(std::string(kByeKey) + std::to_string(opts_.rank), std::vector<char>{1});
    std::vector<std::string> keys;
    for (int r = 0; r < opts_.world_size; ++r) keys.push_back(std::string(kByeKey) + std::to_string(r));
    store_->wait(keys, teardown_->earlier(10000).remaining());
  } catch (const std::exception& e) {
    SF_LOG(kInfo, "nccl", "goodbye: not every rank said goodbye (" << e.what()
                                                                     << "); tearing the communicator down");
  } catch (...) {
  }
}

void* NcclBackend::allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  void* p = nullptr;
  sfn_error err;
  check(api_.mem_alloc(device(), bytes, &p, &err), err);
  return p;
}

void NcclBackend::deallocate(void* p) noexcept {
  if (device_) api_.mem_free(device_, p);
}

void NcclBackend::copy(void* dst, const void* src, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  sfn_error err;
  check(api_.mem_copy(device(), dst, src, bytes, &err), err);
}

void NcclBackend::zero(void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  sfn_error err;
  check(api_.mem_zero(device(), p, bytes, &err), err);
}

void NcclBackend::writeSmall(void* dst, const void* src, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  sfn_error err;
  check(api_.mem_write(device(), dst, src, bytes, &err), err);
}

void NcclBackend::readSmall(void* dst, const void* src, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  sfn_error err;
  check(api_.mem_read(device(), dst, src, bytes, opts_.timeout_ms, &err), err);
}

void NcclBackend::broadcast(void*, size_t, int) {
  fail(SF_ERR_UNSUPPORTED, "sf_broadcast copies host memory, which needs the Gloo transport: "
                           "with backend = nccl it is not available (use backend = auto)");
}

}  // namespace sfsync

#pragma once
// CountingBackend: what a context's collectives put on the wire (sf_stats'
// wire_* fields, since 0.5), counted in one place. The Context puts one
// around every backend it is handed; it forwards every call unchanged and,
// for each collective, adds its kind and its payload bytes by purpose to
// the context's WireCount. Responsible for reading kind, size and purpose
// off the call (ReduceSpec says which elements are data, mask, the reserved
// tail and its weight limbs, and whether a gather carries parameters) and
// for asking the backend how it carries them (Backend::allreduceWireDtype,
// Backend::movesPadding). Not responsible for what the transport adds
// (message headers) or how its algorithm splits the bytes between peers:
// the payload is the buffer as handed over (include/sfsync.h, sf_stats).
// Nothing is counted at world size 1 (nothing travels).

#include <cstdint>
#include <memory>
#include <mutex>

#include "plugin/backend/backend.h"

namespace sfsync {

struct WireCounts {
  int64_t allreduces = 0;
  int64_t reduceScatters = 0;
  int64_t allGathers = 0;
  int64_t broadcasts = 0;
  int64_t controls = 0;
  int64_t bytes = 0;  // the sum of the purposes below
  int64_t gradientBytes = 0;
  int64_t parameterBytes = 0;
  int64_t maskBytes = 0;
  int64_t checkBytes = 0;
  int64_t weightBytes = 0;
  int64_t hostBytes = 0;
};

// A context's counts, shared by its CountingBackends; read from any thread.
class WireCount {
 public:
  void add(const WireCounts& c);
  WireCounts counts() const;

 private:
  mutable std::mutex mutex_;
  WireCounts c_;
};

// The bucket collectives CountingBackend counts.
enum class BucketCollective { kAllreduce, kReduceScatter, kAllGather };

// The payload of one bucket collective, by purpose, as CountingBackend
// counts it (pure; exposed for tests). `elems`: the buffer of an all-reduce,
// or per segment (`world` segments) of a reduce-scatter or all-gather.
// `wireBytes`: the size of an element on the wire; `padding`: whether the
// backend moves the padding spec.segmentUsed leaves.
WireCounts bucketPayload(BucketCollective kind, int64_t elems, int64_t world, int64_t wireBytes,
                         bool padding, const ReduceSpec& spec);

class CountingBackend : public Backend {
 public:
  CountingBackend(std::unique_ptr<Backend> inner, WireCount& count, int64_t world)
      : inner_(std::move(inner)), count_(count), world_(world) {}
  Backend& inner() { return *inner_; }

  const char* name() const override { return inner_->name(); }
  void connect() override { inner_->connect(); }
  std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                       ReduceSpec spec) override;
  std::unique_ptr<Work> startReduceScatter(void* data, int64_t segmentElems, sf_dtype dtype,
                                           ReduceSpec spec) override;
  std::unique_ptr<Work> startAllgather(void* data, int64_t segmentElems, sf_dtype dtype,
                                       ReduceSpec spec) override;
  std::unique_ptr<Work> startScale(void* data, int64_t numel, sf_dtype dtype,
                                   double factor) override {
    return inner_->startScale(data, numel, dtype, factor);  // no wire
  }
  void allreduceSumFloat64(double* data, int64_t n) override;
  void allreduceMaxInt64(int64_t* data, int64_t n) override;
  void barrierQuietly() noexcept override { inner_->barrierQuietly(); }
  void broadcast(void* data, size_t bytes, int root) override;
  void setHostStream(void* stream) override { inner_->setHostStream(stream); }
  void adopt(void* comm) override { inner_->adopt(comm); }
  void checkDeviceMemory(const void* p, size_t bytes) override { inner_->checkDeviceMemory(p, bytes); }
  sf_dtype allreduceWireDtype(sf_dtype dtype) const override { return inner_->allreduceWireDtype(dtype); }
  bool scalesInAPass(sf_dtype dtype) const override { return inner_->scalesInAPass(dtype); }
  bool movesPadding(const ReduceSpec& spec, int64_t segmentElems) const override {
    return inner_->movesPadding(spec, segmentElems);
  }

  void* allocate(size_t bytes) override { return inner_->allocate(bytes); }
  void deallocate(void* p) noexcept override { inner_->deallocate(p); }
  void copy(void* dst, const void* src, size_t bytes) override { inner_->copy(dst, src, bytes); }
  void zero(void* p, size_t bytes) override { inner_->zero(p, bytes); }
  void writeSmall(void* dst, const void* src, size_t bytes) override { inner_->writeSmall(dst, src, bytes); }
  void readSmall(void* dst, const void* src, size_t bytes) override { inner_->readSmall(dst, src, bytes); }

 private:
  void add(const WireCounts& c) {
    if (world_ > 1) count_.add(c);
  }
  // A reduce-scatter's or all-gather's payload (`world_` segments, the
  // element as the dtype, the padding as the inner backend moves it).
  WireCounts segmentPayload(BucketCollective kind, int64_t segmentElems, sf_dtype dtype,
                            const ReduceSpec& spec) const;

  std::unique_ptr<Backend> inner_;
  WireCount& count_;
  int64_t world_;
};

}  // namespace sfsync

#pragma once
// RecordingBackend: a Backend (plugin/backend/backend.h) for unit tests
// that writes down every call and plays `world` ranks holding exactly this
// rank's values (mirror ranks): a reduction's sum is world times the
// values, then the scales the caller asked for on the leading scaled
// elements (the reserved tail after them summed unscaled, as the window
// check and the weighted limbs expect); a reduce-scatter does that on this
// rank's segment; an all-gather leaves everything in place (every mirror
// rank's segment already holds this rank's values). No socket, no thread,
// no peer; float32 only. Used by the orchestrator's and the reducer's room
// suites (Context through a BackendMaker, Reducer as the backend handed to
// it with each gradient, Reducer::addGradient).

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"

namespace sftest {

using sfsync::ReduceSpec;
using sfsync::Work;

struct Call {
  std::string op;      // connect, allreduce, reduce_scatter, allgather, max_int64, sum_float64,
                       // broadcast, barrier, host_stream, check_device_memory
  int64_t elems = 0;   // elements (per segment for the sharded collectives)
  sf_dtype dtype = SF_DTYPE_FLOAT32;
  int64_t bucket = -1;
  double scale = 1.0;  // prescale * postscale
  int64_t scaledElems = -1;
};

class DoneWork : public Work {
 public:
  void wait() override {}
};

class RecordingBackend : public sfsync::Backend {
 public:
  RecordingBackend(std::vector<Call>& log, int world, int rank)
      : log_(log), world_(world), rank_(rank) {}
  const char* name() const override { return "recording"; }
  void connect() override { log_.push_back({"connect"}); }

  std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                       ReduceSpec spec) override {
    log_.push_back({"allreduce", numel, dtype, spec.bucket, spec.prescale * spec.postscale,
                    spec.scaledElems});
    mirrorSum(data, 0, numel, dtype, spec);
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> startReduceScatter(void* data, int64_t segmentElems, sf_dtype dtype,
                                           ReduceSpec spec) override {
    log_.push_back({"reduce_scatter", segmentElems, dtype, spec.bucket,
                    spec.prescale * spec.postscale, spec.scaledElems});
    mirrorSum(data, segmentElems * rank_, segmentElems, dtype, spec);  // this rank's segment
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> startAllgather(void*, int64_t segmentElems, sf_dtype dtype,
                                       ReduceSpec spec) override {
    // Mirror ranks: every rank's segment already holds what this one's does.
    log_.push_back({"allgather", segmentElems, dtype, spec.bucket});
    return std::make_unique<DoneWork>();
  }
  void allreduceSumFloat64(double* data, int64_t n) override {
    log_.push_back({"sum_float64", n, SF_DTYPE_FLOAT64});
    for (int64_t i = 0; i < n; ++i) data[i] *= world_;
  }
  void allreduceMaxInt64(int64_t*, int64_t n) override {
    log_.push_back({"max_int64", n, SF_DTYPE_FLOAT64});  // the max of equal values: unchanged
  }
  void barrierQuietly() noexcept override { log_.push_back({"barrier"}); }
  void broadcast(void*, size_t bytes, int) override {
    log_.push_back({"broadcast", int64_t(bytes), SF_DTYPE_FLOAT32});
  }
  void setHostStream(void*) override { log_.push_back({"host_stream"}); }
  void checkDeviceMemory(const void*, size_t bytes) override {
    log_.push_back({"check_device_memory", int64_t(bytes)});
  }

 private:
  // world * x on [first, first + n), then the scale on the leading scaled
  // elements (the reserved tail after them summed unscaled).
  void mirrorSum(void* data, int64_t first, int64_t n, sf_dtype dtype, const ReduceSpec& spec) {
    BOOST_REQUIRE_MESSAGE(dtype == SF_DTYPE_FLOAT32, "this backend reduces float32 only");
    float* v = static_cast<float*>(data) + first;
    const int64_t scaled = spec.scaledElems < 0 ? n : std::min(n, spec.scaledElems);
    for (int64_t i = 0; i < n; ++i) v[i] *= float(world_);
    for (int64_t i = 0; i < scaled; ++i) v[i] = float(v[i] * (spec.prescale * spec.postscale));
  }

  std::vector<Call>& log_;
  int world_;
  int rank_;
};

}  // namespace sftest

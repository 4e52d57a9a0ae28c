// CountingBackend: see counting_backend.h. The payload rules are written
// once, in bucketPayload; the calls only say which rule applies.

#include "plugin/backend/counting_backend.h"

#include <algorithm>

#include "plugin/core/dtype.h"

namespace sfsync {

void WireCount::add(const WireCounts& c) {
  std::lock_guard<std::mutex> lock(mutex_);
  c_.allreduces += c.allreduces;
  c_.reduceScatters += c.reduceScatters;
  c_.allGathers += c.allGathers;
  c_.broadcasts += c.broadcasts;
  c_.controls += c.controls;
  c_.bytes += c.bytes;
  c_.gradientBytes += c.gradientBytes;
  c_.parameterBytes += c.parameterBytes;
  c_.maskBytes += c.maskBytes;
  c_.checkBytes += c.checkBytes;
  c_.weightBytes += c.weightBytes;
  c_.hostBytes += c.hostBytes;
}

WireCounts WireCount::counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return c_;
}

// Per segment: the data elements (spec.segmentUsed[r], or all up to
// scaledElems; all of them where the backend moves the padding), then the
// reserved tail after scaledElems, of which the weight's limbs are the
// weighted window's and the rest (window check, alignment) the check's.
// An all-reduce is one segment whose padding is none.
WireCounts bucketPayload(BucketCollective kind, int64_t elems, int64_t world, int64_t wireBytes,
                         bool padding, const ReduceSpec& spec) {
  WireCounts c;
  const bool allreduce = kind == BucketCollective::kAllreduce;
  const int64_t segments = allreduce ? 1 : world;
  const int64_t dataEnd = spec.dataEnd(elems);
  const int64_t tail = elems - dataEnd;
  int64_t data = 0;
  for (int64_t r = 0; r < segments; ++r) {
    const bool listed = !allreduce && !padding && size_t(r) < spec.segmentUsed.size();
    data += listed ? std::min(dataEnd, spec.segmentUsed[size_t(r)]) : dataEnd;
  }
  const int64_t limbs = std::min(tail, spec.weightElems);
  const int64_t mask = std::min(data, spec.maskElems);
  const int64_t dataBytes = (data - mask) * wireBytes;
  if (spec.payload == ReduceSpec::Payload::kParameters) {
    c.parameterBytes = dataBytes;
  } else {
    c.gradientBytes = dataBytes;
  }
  c.maskBytes = mask * wireBytes;
  c.weightBytes = segments * limbs * wireBytes;
  c.checkBytes = segments * (tail - limbs) * wireBytes;
  c.bytes = c.gradientBytes + c.parameterBytes + c.maskBytes + c.weightBytes + c.checkBytes;
  c.allreduces = allreduce ? 1 : 0;
  c.reduceScatters = kind == BucketCollective::kReduceScatter ? 1 : 0;
  c.allGathers = kind == BucketCollective::kAllGather ? 1 : 0;
  return c;
}

std::unique_ptr<Work> CountingBackend::startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                                      ReduceSpec spec) {
  const int64_t wire = int64_t(dtypeSize(inner_->allreduceWireDtype(dtype)));
  WireCounts c = bucketPayload(BucketCollective::kAllreduce, numel, world_, wire, true, spec);
  auto work = inner_->startAllreduce(data, numel, dtype, std::move(spec));
  add(c);
  return work;
}

WireCounts CountingBackend::segmentPayload(BucketCollective kind, int64_t segmentElems,
                                           sf_dtype dtype, const ReduceSpec& spec) const {
  return bucketPayload(kind, segmentElems, world_, int64_t(dtypeSize(dtype)),
                       inner_->movesPadding(spec, segmentElems), spec);
}

std::unique_ptr<Work> CountingBackend::startReduceScatter(void* data, int64_t segmentElems,
                                                          sf_dtype dtype, ReduceSpec spec) {
  WireCounts c = segmentPayload(BucketCollective::kReduceScatter, segmentElems, dtype, spec);
  auto work = inner_->startReduceScatter(data, segmentElems, dtype, std::move(spec));
  add(c);
  return work;
}

std::unique_ptr<Work> CountingBackend::startAllgather(void* data, int64_t segmentElems,
                                                      sf_dtype dtype, ReduceSpec spec) {
  WireCounts c = segmentPayload(BucketCollective::kAllGather, segmentElems, dtype, spec);
  auto work = inner_->startAllgather(data, segmentElems, dtype, std::move(spec));
  add(c);
  return work;
}

void CountingBackend::allreduceSumFloat64(double* data, int64_t n) {
  inner_->allreduceSumFloat64(data, n);
  WireCounts c;
  c.controls = 1;
  c.hostBytes = c.bytes = n * int64_t(sizeof(double));
  add(c);
}

void CountingBackend::allreduceMaxInt64(int64_t* data, int64_t n) {
  inner_->allreduceMaxInt64(data, n);
  WireCounts c;
  c.controls = 1;
  c.checkBytes = c.bytes = n * int64_t(sizeof(int64_t));
  add(c);
}

void CountingBackend::broadcast(void* data, size_t bytes, int root) {
  inner_->broadcast(data, bytes, root);
  WireCounts c;
  c.broadcasts = 1;
  c.hostBytes = c.bytes = int64_t(bytes);
  add(c);
}

}  // namespace sfsync

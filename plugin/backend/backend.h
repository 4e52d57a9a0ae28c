#pragma once
// The backend interface: what the reducer needs from a transport. A backend
// reduces buckets across ranks; it does not know about windows or gradients.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "sfsync.h"

namespace sfsync {

class Tracer;

// How a bucket is combined: sum, optionally scaled before (prescale) and
// after (postscale: 1/world_size for averaging). A factor of 1 means none.
struct ReduceSpec {
  double prescale = 1.0;
  double postscale = 1.0;
  // Elements from the start of the buffer (of each segment, sharded) that
  // the scales apply to (-1: all); the elements after them, a tail the
  // caller reserved for its own values, are summed unscaled.
  int64_t scaledElems = -1;
  // Where the scaled data of a buffer (a segment) of `elems` elements ends.
  int64_t dataEnd(int64_t elems) const { return scaledElems < 0 ? elems : std::min(elems, scaledElems); }
  int64_t bucket = -1;       // the bucket's index, for the trace
  Tracer* trace = nullptr;   // SF_TRACE: where a backend records wire events
  // Reduce-scatter and all-gather: per segment, the leading elements that
  // hold data (ShardLayout::used); the elements from there up to
  // scaledElems (the reserved tail; -1: the segment's end) are padding, which
  // a backend may leave off the wire (their values afterwards: as before the
  // call, or summed). Empty: every element holds data.
  std::vector<int64_t> segmentUsed;
  // For the wire counts (sf_stats.wire_*, counting_backend.h) only; no
  // backend reads them. A weighted window's limbs (the reducer's
  // window_totals.h: they ride in the reserved tail and are summed as the
  // rest of it; the reducer decodes them and asks startScale() afterwards):
  // weightAt, where they start in each segment's tail, and weightElems, how
  // many (the weight's, and in bucket 0 the window sums'); maskElems: of
  // the data elements, those of the used-parameter mask (a gradient named
  // "sfsync.used"); payload: what a gather carries.
  int64_t weightAt = 0;
  int64_t weightElems = 0;
  int64_t maskElems = 0;
  enum class Payload { kGradients, kParameters };
  Payload payload = Payload::kGradients;
};

// A collective in flight. wait() returns when it is done and throws
// sfsync::Error (SF_ERR_BACKEND or SF_ERR_TIMEOUT) if it failed.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
};

// The memory a backend's collectives work on, as the reducer needs it for
// flat buffers, staging copies and zeroing. The defaults are host memory; a
// device backend (NCCL) overrides all four, ordering copies and zeroing with
// its collectives and the host's stream.
class MemoryOps {
 public:
  virtual ~MemoryOps() = default;
  // `bytes` of zeroed memory; throws SF_ERR_OUT_OF_MEMORY.
  virtual void* allocate(size_t bytes) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded ? rounded : 64);
    if (!p) fail(SF_ERR_OUT_OF_MEMORY, "cannot allocate " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, bytes);
    return p;
  }
  virtual void deallocate(void* p) noexcept { std::free(p); }
  virtual void copy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
  virtual void zero(void* p, size_t bytes) { std::memset(p, 0, bytes); }
  // A few bytes of window-check values between host memory and this memory:
  // write from host `src` to `dst`, ordered before the next collective's
  // start; read `src` into host `dst` once the collectives before it are
  // done, bounded by the timeout. ("Small": "control" names only the small
  // control collectives below.)
  virtual void writeSmall(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
  virtual void readSmall(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

  // Host memory, for gradients that no backend owns yet.
  static MemoryOps& host() {
    static MemoryOps ops;
    return ops;
  }
};

class Backend : public MemoryOps {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // Collective: join the peers. Idempotent; called before the first collective.
  virtual void connect() = 0;

  // Start an in-place reduction of `numel` elements at `data`. Buckets are
  // started in the same order on every rank; the backend keeps that order.
  virtual std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                               ReduceSpec spec) = 0;

  // Since 0.3 (sharded windows). Start an in-place reduce-scatter: `data`
  // holds world_size segments of `segmentElems` elements each; afterwards
  // segment `rank` holds the elementwise sum over ranks, its first
  // spec.scaledElems elements (-1: all) multiplied by prescale * postscale
  // (the window-check elements after them summed as they are);
  // the other segments hold unspecified values. Started in the same order on
  // every rank, in one sequence with startAllreduce.
  virtual std::unique_ptr<Work> startReduceScatter(void* data, int64_t segmentElems,
                                                   sf_dtype dtype, ReduceSpec spec) {
    (void)data, (void)segmentElems, (void)dtype, (void)spec;
    fail(SF_ERR_UNSUPPORTED, std::string("the ") + name() + " backend has no reduce-scatter");
  }
  // Start an in-place all-gather: segment `rank` of `data` (world_size
  // segments of `segmentElems`) to every rank. A sequence of its own
  // (parameter gathers are ordered among themselves, not with the
  // reductions, and may overlap them); spec.bucket / spec.trace only.
  virtual std::unique_ptr<Work> startAllgather(void* data, int64_t segmentElems, sf_dtype dtype,
                                               ReduceSpec spec) {
    (void)data, (void)segmentElems, (void)dtype, (void)spec;
    fail(SF_ERR_UNSUPPORTED, std::string("the ") + name() + " backend has no all-gather");
  }
  // Since 0.5: the scaling step after a plain reduction (a weighted
  // window's 1 / global weight, which the reducer decodes): multiply
  // `numel` elements at `data`, this backend's memory, by `factor` in place,
  // after the reductions started before it. The default: host memory, done
  // on return.
  virtual std::unique_ptr<Work> startScale(void* data, int64_t numel, sf_dtype dtype,
                                           double factor) {
    scaleInPlace(data, numel, dtype, factor);
    struct Done : Work {
      void wait() override {}
    };
    return std::make_unique<Done>();
  }
  // Blocking, control path (sf_allreduce_float64): elementwise sum of `n`
  // float64 values in host memory across ranks. No reduction may be in flight.
  virtual void allreduceSumFloat64(double* data, int64_t n) {
    (void)data, (void)n;
    fail(SF_ERR_UNSUPPORTED, std::string("the ") + name() + " backend has no float64 control sum");
  }

  // Blocking, for control messages (the layout check): elementwise max of
  // `n` int64 values in host memory across ranks. No work may be in flight.
  virtual void allreduceMaxInt64(int64_t* data, int64_t n) = 0;

  // Best effort before teardown, once every collective of this rank is
  // done, so that no rank tears its connections down while a peer still
  // reads from them; bounded by the timeout; never throws. It must never be
  // a collective that could pair with a peer's gradient collective (NCCL
  // matches by issue order and checks nothing): a peer still synchronizing
  // then gets an error, never a result mixed with teardown bytes.
  virtual void barrierQuietly() noexcept = 0;

  // Blocking: copy `bytes` bytes of host memory at `data` from rank `root`
  // to every rank (sf_broadcast). Every rank passes the same bytes and root
  // (the caller checks); no work may be in flight.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;

  // ---- What a device backend adds (the defaults: a host backend's answers).
  // The host's stream (a cudaStream_t; NULL: the legacy default stream)
  // that collectives order after. Nothing for host memory.
  virtual void setHostStream(void* stream) { (void)stream; }
  // Use the host's communicator (an ncclComm_t) from now on, before the
  // first collective; checks its rank, size and device against the options.
  virtual void adopt(void* comm) {
    (void)comm;
    fail(SF_ERR_UNSUPPORTED, std::string("the ") + name() + " backend has no communicator to adopt");
  }
  // How the bytes travel, for the wire counts (sf_stats.wire_*): the dtype a
  // bucket all-reduce of `dtype` puts on the wire (Gloo: wire_dtype for
  // float32), and whether this reduce-scatter or all-gather (`spec`, its
  // segments of `segmentElems`) moves the padding that
  // ReduceSpec::segmentUsed marks (Gloo leaves it off; NCCL too since 0.5
  // where the padding is a sizeable share, unless its module predates the
  // entries that do it).
  virtual sf_dtype allreduceWireDtype(sf_dtype dtype) const { return dtype; }
  // Since 0.5: whether a bucket all-reduce of `dtype` applies its scales
  // (ReduceSpec) as a pass of its own over host memory (Gloo without a
  // 16-bit wire). The reducer may then scale each gradient as it is
  // reported ready, while its memory is warm, and start a plain sum
  // (Reducer::readyScaleOf). False where the scale is fused (NCCL's
  // ncclAvg, the 16-bit wire's narrowing) or there is no collective.
  virtual bool scalesInAPass(sf_dtype dtype) const { (void)dtype; return false; }
  virtual bool movesPadding(const ReduceSpec& spec, int64_t segmentElems) const {
    (void)spec, (void)segmentElems;
    return true;
  }
  // SF_ERR_INVALID_ARGUMENT unless [p, p + bytes) is memory this backend
  // reduces in place (a device backend: this rank's GPU). Host memory: anything.
  virtual void checkDeviceMemory(const void* p, size_t bytes) { (void)p, (void)bytes; }
};

}  // namespace sfsync

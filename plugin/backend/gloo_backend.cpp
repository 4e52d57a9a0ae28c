#include "plugin/backend/gloo_backend.h"

#include <netdb.h>
#include <sys/socket.h>

#include <future>
#include <mutex>
#include <functional>

#include <gloo/allreduce.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include "plugin/backend/gloo_mesh.h"
#include "plugin/backend/gloo_ring.h"
#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/rendezvous/rendezvous.h"
#include "plugin/core/tracer.h"
#include "plugin/core/deadline.h"
#include "plugin/rendezvous/store_factory.h"

namespace sfsync {

namespace {

// Buckets larger than this travel as several collectives on consecutive
// lanes (with one lane, whole). 8 MiB: a DDP-sized bucket (a few MiB) stays
// one collective, whose ring pipelines its own segments; a larger one keeps
// several lanes busy (sfsync-bench: 0.86-1.01x one raw all-reduce at 16 and
// 64 MiB, where 4 MiB pieces on 4 lanes made end-to-end windows 1-5 % slower).
constexpr int64_t kWireChunkBytes = 8 << 20;

// Runs f, turning whatever Gloo throws into sfsync::Error.
template <typename F>
void glooCall(const char* what, F&& f) {
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string m = e.what();
    const bool timedOut = m.find("imed out") != std::string::npos ||
                          m.find("imeout") != std::string::npos;
    fail(timedOut ? SF_ERR_TIMEOUT : SF_ERR_BACKEND, std::string("gloo ") + what + ": " + m);
  }
}

// Elements per piece of a collective over `elems` elements of `elemBytes`
// that puts `wireBytes` on the wire: pieces of at most kWireChunkBytes on
// the wire each (with one lane: whole), whole 64-byte lines.
int64_t pieceElemsOf(int64_t elems, int64_t elemBytes, int64_t wireBytes, size_t lanes) {
  if (lanes <= 1 || wireBytes <= kWireChunkBytes) return elems;
  const int64_t lineElems = std::max<int64_t>(1, 64 / elemBytes);
  const int64_t pieces = (wireBytes + kWireChunkBytes - 1) / kWireChunkBytes;
  return ((elems + pieces - 1) / pieces + lineElems - 1) / lineElems * lineElems;
}

// A piece's span on its track (SF_TRACE), written when it goes out of scope:
// also when the piece fails. `wireBytes` is read then (a ring piece learns
// its bytes as it runs); `wireDtype` is added when given.
class PieceSpan {
 public:
  PieceSpan(Tracer* trace, int track, std::string trackName, const char* what, int64_t bucket,
            int64_t piece, const int64_t* wireBytes, const char* wireDtype = nullptr)
      : trace_(trace), track_(track), trackName_(std::move(trackName)), what_(what),
        bucket_(bucket), piece_(piece), wireBytes_(wireBytes), wireDtype_(wireDtype),
        t0_(trace ? Tracer::nowUs() : 0) {}
  PieceSpan(const PieceSpan&) = delete;
  PieceSpan& operator=(const PieceSpan&) = delete;
  ~PieceSpan() {
    if (!trace_) return;
    std::string args = "\"bucket\":" + std::to_string(bucket_) + ",\"piece\":" +
                       std::to_string(piece_) + ",\"wire_bytes\":" + std::to_string(*wireBytes_);
    if (wireDtype_) args += ",\"wire_dtype\":\"" + std::string(wireDtype_) + "\"";
    trace_->nameTrack(track_, trackName_);
    trace_->span(track_, what_, t0_, Tracer::nowUs(), args);
  }

 private:
  Tracer* trace_;
  int track_;
  std::string trackName_;
  const char* what_;
  int64_t bucket_, piece_;
  const int64_t* wireBytes_;
  const char* wireDtype_;
  double t0_;
};

template <typename T>
void setBuffer(gloo::AllreduceOptions& opts, void* data, int64_t numel) {
  opts.setOutput(static_cast<T*>(data), size_t(numel));
}

// A bucket's collective: one or more pieces on lanes. wait() waits for every
// piece (none may still write into the bucket after it returns), then
// reports the first failure.
class GlooWork : public Work {
 public:
  GlooWork(std::vector<std::future<TaskResult>> pieces, std::chrono::milliseconds timeout)
      : pieces_(std::move(pieces)), timeout_(timeout) {}
  void wait() override {
    TaskResult first;
    for (auto& f : pieces_) {
      TaskResult r;
      // Gloo enforces the timeout itself; the grace period covers scheduling.
      if (f.wait_for(timeout_ + std::chrono::seconds(5)) != std::future_status::ready) {
        r = {SF_ERR_TIMEOUT, "gloo allreduce: no completion within timeout_ms = " +
                                 std::to_string(timeout_.count())};
      } else {
        r = f.get();
      }
      if (first.status == SF_OK) first = r;
    }
    pieces_.clear();
    first.throwIfFailed();
  }

 private:
  std::vector<std::future<TaskResult>> pieces_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

GlooBackend::GlooBackend(const sf_options& opts)
    : GlooBackend(opts, std::make_shared<Rendezvous>(opts, Rendezvous::Admission::kSkip)) {}

GlooBackend::GlooBackend(const sf_options& opts, std::shared_ptr<Rendezvous> rendezvous)
    : opts_(opts), rendezvous_(std::move(rendezvous)) {
  const size_t lanes = size_t(std::max(1, opts_.max_inflight));
  for (size_t k = 1; k < lanes; ++k) laneExecutors_.push_back(std::make_unique<OrderedExecutor>());
}

GlooBackend::~GlooBackend() = default;

void GlooBackend::connect() {
  if (lanes_ != 0) return;
  // On the worker thread: Gloo's event loop inherits its blocked SIGPIPE.
  // Every wait inside is bounded by timeout_ms; this bound (plus the
  // documented slack) keeps the caller's promise even if one were not.
  if (!context_) {
    std::future<TaskResult> done = executor_.submit([this] { connectHere(); });
    if (done.wait_until(deadlineAfter(std::chrono::milliseconds(opts_.timeout_ms)) +
                        std::chrono::seconds(2)) != std::future_status::ready) {
      fail(SF_ERR_TIMEOUT, "gloo connect: no result within timeout_ms = " +
                               std::to_string(opts_.timeout_ms) + " (+2 s)");
    }
    done.get().throwIfFailed();
  }
  // Lanes share this context: one connection per peer, each collective with
  // a tag of its own (Gloo keeps concurrent collectives on a pair apart by
  // tag), so extra lanes cost a thread, not a connection.
  lanes_ = laneExecutors_.size() + 1;
  wireScratch_.resize(lanes_);
  ringScratch_.resize(lanes_);
}

namespace {
// Gloo 0.5's device walks getaddrinfo's result without checking its status:
// a name that does not resolve gives an enforce failure at best, and where
// the lookup fails otherwise (no route to a resolver: a container without
// /etc/hosts, a network namespace) a SIGSEGV in every rank. Asked here first.
void requireResolvable(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rv = ::getaddrinfo(host.c_str(), nullptr, &hints, &result);
  const bool found = rv == 0 && result != nullptr;
  if (result != nullptr) ::freeaddrinfo(result);
  if (!found) {
    fail(SF_ERR_BACKEND, "gloo connect: this host's name '" + host + "' does not resolve (" +
                             (rv != 0 ? ::gai_strerror(rv) : "no address") +
                             "): set SF_GLOO_HOSTNAME to an address of this host that the "
                             "other ranks can reach (127.0.0.1 for a job on one machine)");
  }
}
}  // namespace

void GlooBackend::connectHere() {
  store_ = rendezvous_->store();
  const std::string host = localHostname(opts_);
  requireResolvable(host);
  glooCall("connect", [&] {
    gloo::transport::tcp::attr attr(host.c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    // Our own full-mesh connect: Gloo's waits 5 x timeout for a silent peer.
    context_ = connectMesh(*store_, device);
    if (opts_.world_size == 2) {  // [Note: a mesh per direction]
      gloo::rendezvous::PrefixStore reverse("reverse", *store_);
      reverse_ = connectMesh(reverse, device);
    }
  });
}

namespace {

// [Note: a mesh per direction] At two ranks a ring sends to and receives
// from the same peer. On one Gloo pair (one socket) a send whose receive is
// known is written by the sending thread under the pair's mutex, which
// Gloo's TCP loop only try-locks: with the peer's bytes arriving on that
// socket the loop spins through epoll_wait for the whole copy (about
// 25,000 calls a transformer window and rank on loopback, 2-3 ms of a
// one-core rank's CPU; gloo_ring.cpp's Note). A second mesh carries the
// bytes from rank 1 to rank 0, so that each socket carries a ring's bytes
// one way and the copy never holds the lock of the socket receiving. From
// three ranks on, a ring's two neighbours are two pairs already.
RingLinks linksOf(gloo::Context& context, gloo::Context* reverse) {
  if (reverse == nullptr) return {context, context};
  return context.rank == 0 ? RingLinks{context, *reverse} : RingLinks{*reverse, context};
}

}  // namespace

std::shared_ptr<gloo::Context> GlooBackend::connectMesh(
    gloo::rendezvous::Store& store, const std::shared_ptr<gloo::transport::Device>& device) {
  // Our bounded connect (Gloo's waits 5 x timeout for a silent peer).
  return connectGlooMesh(store, device, opts_.rank, opts_.world_size,
                         std::chrono::milliseconds(opts_.timeout_ms));
}

GlooBackend::PieceSlot GlooBackend::nextPieceSlot() {
  // Tags 1..2^31-1 (0 is the control collectives', 2^31.. the gathers'):
  // the same on every rank, distinct among the pieces that can be in flight
  // together.
  const PieceSlot slot{1 + uint32_t(nextPiece_ % 0x7fffffffu), size_t(nextPiece_ % lanes_)};
  ++nextPiece_;
  return slot;
}

void GlooBackend::noteFailure(sf_status status, const std::string& message) {
  std::lock_guard<std::mutex> lock(failureMutex_);
  if (failed_.load()) return;
  failureStatus_ = status;
  failure_ = message;
  failed_.store(true);
}

void GlooBackend::throwIfFailed() {
  if (!failed_.load()) return;
  std::lock_guard<std::mutex> lock(failureMutex_);
  throw Error(failureStatus_, "an earlier collective failed: " + failure_);
}

namespace {

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

void reduceNative(const std::shared_ptr<gloo::Context>& context, void* data, int64_t numel,
                  sf_dtype dtype, uint32_t tag = 0) {
  gloo::AllreduceOptions opts(context);
  opts.setTag(tag);
  switch (dtype) {
    case SF_DTYPE_FLOAT32: setBuffer<float>(opts, data, numel); break;
    case SF_DTYPE_FLOAT64: setBuffer<double>(opts, data, numel); break;
    default: setBuffer<uint16_t>(opts, data, numel); break;  // 16-bit floats
  }
  // Our own sum for every dtype (16-bit: through float32): addInto's loops
  // are vectorized (plugin/CMakeLists.txt), Gloo's sum<T> here would not be.
  opts.setReduceFunction([dtype](void* c, const void* a, const void* b, size_t n) {
    addInto(c, a, b, n, dtype);
  });
  gloo::allreduce(opts);
}

}  // namespace

std::unique_ptr<Work> GlooBackend::startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                                  ReduceSpec spec) {
  connect();
  throwIfFailed();
  const sf_dtype wire = allreduceWireDtype(dtype);
  // Pieces sized in the bucket's own dtype, on consecutive lanes.
  const int64_t elemBytes = int64_t(dtypeSize(dtype));
  const int64_t pieceElems = pieceElemsOf(numel, elemBytes, numel * elemBytes, lanes_);
  std::vector<std::future<TaskResult>> futures;
  int64_t count = 0;
  for (int64_t begin = 0; begin < numel || (numel == 0 && futures.empty()); begin += count) {
    count = std::min(pieceElems, numel - begin);
    void* at = static_cast<char*>(data) + begin * elemBytes;
    // The reducer serializes its calls: the same sequence on every rank.
    const PieceSlot slot = nextPieceSlot();
    const uint32_t tag = slot.tag;
    const size_t lane = slot.lane;
    auto context = context_;
    std::vector<uint16_t>* scratch = &wireScratch_[lane];  // only this lane's thread uses it
    auto reverse = reverse_;
    const int64_t piece = int64_t(futures.size());
    auto task = [this, context, reverse, scratch, at, begin, count, dtype, wire, spec, lane, piece,
                 tag] {
      throwIfFailed();  // another lane failed: fail now, not at this lane's timeout
      const int64_t wireBytes = count * int64_t(dtypeSize(wire));
      const PieceSpan span(spec.trace, int(1 + lane), "lane " + std::to_string(lane), "wire",
                           spec.bucket, piece, &wireBytes, dtypeName(wire));
      // The scales apply to this piece's first `scaled` elements (all but a
      // window-check bucket's two window-check elements, summed as they are).
      const int64_t scaled = spec.scaledElems < 0
                                 ? count
                                 : std::max<int64_t>(0, std::min(count, spec.scaledElems - begin));
      try {
        if (wire != dtype) {
          // float32 carried as 16 bits, each rank's own values added unrounded.
          glooCall("allreduce (16-bit wire)", [&] {
            ringAllreduce16(linksOf(*context, reverse.get()), static_cast<float*>(at), count,
                            scaled, wire,
                            float(spec.prescale), float(spec.postscale), tag,
                            std::chrono::milliseconds(opts_.timeout_ms), *scratch);
          });
          return;
        }
        if (spec.prescale != 1.0) scaleInPlace(at, scaled, dtype, spec.prescale);
        glooCall("allreduce", [&] { reduceNative(context, at, count, dtype, tag); });
        if (spec.postscale != 1.0) scaleInPlace(at, scaled, dtype, spec.postscale);
      } catch (const Error& e) {
        noteFailure(e.status(), e.what());
        throw;
      }
    };
    futures.push_back(executorOf(lane).submit(task));
    if (numel == 0) break;
  }
  return std::make_unique<GlooWork>(std::move(futures),
                                    std::chrono::milliseconds(opts_.timeout_ms));
}

std::unique_ptr<Work> GlooBackend::startReduceScatter(void* data, int64_t segmentElems,
                                                      sf_dtype dtype, ReduceSpec spec) {
  connect();
  throwIfFailed();
  const int64_t elemBytes = int64_t(dtypeSize(dtype));
  // A segment's piece puts world_size times its bytes on the wire.
  const int64_t pieceElems = std::max<int64_t>(
      1, pieceElemsOf(segmentElems, elemBytes, segmentElems * elemBytes * opts_.world_size, lanes_));
  const std::chrono::milliseconds timeout(opts_.timeout_ms);
  std::vector<std::future<TaskResult>> futures;
  int64_t count = 0;
  for (int64_t begin = 0; begin < segmentElems; begin += count) {
    count = std::min(pieceElems, segmentElems - begin);
    // One sequence with the all-reduces: the same tags and lanes on every rank.
    const PieceSlot slot = nextPieceSlot();
    const uint32_t tag = slot.tag;
    const size_t lane = slot.lane;
    auto context = context_;
    std::vector<char>* scratch = &ringScratch_[lane];  // only this lane's thread uses it
    auto reverse = reverse_;
    const int64_t piece = int64_t(futures.size());
    char* base = static_cast<char*>(data);
    auto task = [this, context, reverse, scratch, base, begin, count, dtype, segmentElems, spec,
                 lane, piece, tag, timeout] {
      throwIfFailed();
      int64_t sent = 0;
      const PieceSpan span(spec.trace, int(1 + lane), "lane " + std::to_string(lane),
                           "reduce_scatter", spec.bucket, piece, &sent);
      try {
        const int64_t dataEnd = spec.dataEnd(segmentElems);
        // Scales on this rank's own piece only (the shard), after the sum:
        // the ring scales each chunk as it takes its last sum.
        glooCall("reduce-scatter", [&] {
          sent = ringReduceScatter(linksOf(*context, reverse.get()),
                                   slicePiece(base, segmentElems, dtype, context->size, begin,
                                              count, spec.segmentUsed, dataEnd),
                                   tag, timeout, *scratch, spec.prescale * spec.postscale,
                                   spec.scaledElems);
        });
        ringBytesSent_.fetch_add(sent);
      } catch (const Error& e) {
        noteFailure(e.status(), e.what());
        throw;
      }
    };
    futures.push_back(executorOf(lane).submit(task));
  }
  return std::make_unique<GlooWork>(std::move(futures), timeout);
}

std::unique_ptr<Work> GlooBackend::startAllgather(void* data, int64_t segmentElems, sf_dtype dtype,
                                                  ReduceSpec spec) {
  connect();
  throwIfFailed();
  const std::chrono::milliseconds timeout(opts_.timeout_ms);
  // Tags 2^31.. : their own sequence, apart from the reductions' 1..2^31-1.
  const uint32_t tag = 0x80000000u | uint32_t(nextGather_++ % 0x7fffffffu);
  auto context = context_;
  auto reverse = reverse_;
  char* base = static_cast<char*>(data);
  auto task = [this, context, reverse, base, segmentElems, dtype, spec, tag, timeout] {
    throwIfFailed();
    int64_t sent = 0;
    const PieceSpan span(spec.trace, int(1 + lanes_), "gather", "all_gather", spec.bucket, 0, &sent);
    try {
      glooCall("all-gather", [&] {
        sent = ringAllgather(linksOf(*context, reverse.get()),
                             slicePiece(base, segmentElems, dtype, context->size, 0, segmentElems,
                                        spec.segmentUsed, segmentElems),
                             tag, timeout);
      });
      ringBytesSent_.fetch_add(sent);
    } catch (const Error& e) {
      noteFailure(e.status(), e.what());
      throw;
    }
  };
  std::vector<std::future<TaskResult>> futures;
  futures.push_back(gatherExecutor_.submit(task));
  return std::make_unique<GlooWork>(std::move(futures), timeout);
}

void GlooBackend::allreduceSumFloat64(double* data, int64_t n) {
  connect();
  auto context = context_;
  executor_
      .submit([context, data, n] {
        glooCall("allreduce (float64 sum)", [&] {
          gloo::AllreduceOptions opts(context);
          opts.setOutput(data, size_t(n));
          opts.setReduceFunction(static_cast<ReduceFn>(&gloo::sum<double>));
          gloo::allreduce(opts);
        });
      })
      .get()
      .throwIfFailed();
}

void GlooBackend::allreduceMaxInt64(int64_t* data, int64_t n) {
  connect();
  auto context = context_;
  executor_
      .submit([context, data, n] {
        glooCall("allreduce (layout check)", [&] {
          gloo::AllreduceOptions opts(context);
          opts.setOutput(data, size_t(n));
          opts.setReduceFunction(static_cast<ReduceFn>(&gloo::max<int64_t>));
          gloo::allreduce(opts);
        });
      })
      .get()
      .throwIfFailed();
}

void GlooBackend::barrierQuietly() noexcept {
  if (lanes_ == 0) return;
  try {
    // Peers may still read from the connections until they are done. A
    // barrier cannot pair with a peer's gradient all-reduce: Gloo matches
    // messages by slot, and barrier slots (kBarrierSlotPrefix) differ from
    // all-reduce ones (kAllreduceSlotPrefix), so a peer still synchronizing
    // waits for its own slot and fails at its timeout or when this rank
    // closes the connections, never with a mixed result.
    const auto timeout = std::chrono::milliseconds(std::min<int64_t>(opts_.timeout_ms, 10000));
    auto context = context_;
    executor_
        .submit([context, timeout] {
          gloo::BarrierOptions opts(context);
          opts.setTimeout(timeout);
          gloo::barrier(opts);
        })
        .wait_for(timeout + std::chrono::seconds(5));
  } catch (...) {
  }
}

void GlooBackend::broadcast(void* data, size_t bytes, int root) {
  connect();
  auto context = context_;
  executor_
      .submit([context, data, bytes, root] {
        glooCall("broadcast", [&] {
          gloo::BroadcastOptions opts(context);
          opts.setOutput(static_cast<uint8_t*>(data), bytes);
          opts.setRoot(root);
          gloo::broadcast(opts);
        });
      })
      .get()
      .throwIfFailed();
}

}  // namespace sfsync

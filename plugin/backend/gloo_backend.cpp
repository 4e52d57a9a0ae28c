#include "plugin/backend/gloo_backend.h"

#include <future>

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/rendezvous/rendezvous.h"
#include "plugin/rendezvous/store_factory.h"

namespace sfsync {

namespace {

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

template <typename T>
void setBuffer(gloo::AllreduceOptions& opts, void* data, int64_t numel) {
  opts.setOutput(static_cast<T*>(data), size_t(numel));
}

class GlooWork : public Work {
 public:
  GlooWork(std::future<TaskResult> f, std::chrono::milliseconds timeout)
      : future_(std::move(f)), timeout_(timeout) {}
  void wait() override {
    // Gloo enforces the timeout itself; the grace period covers scheduling.
    if (future_.wait_for(timeout_ + std::chrono::seconds(5)) != std::future_status::ready) {
      fail(SF_ERR_TIMEOUT, "gloo allreduce: no completion within timeout_ms = " +
                               std::to_string(timeout_.count()));
    }
    future_.get().throwIfFailed();
  }

 private:
  std::future<TaskResult> future_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

GlooBackend::GlooBackend(const sf_options& opts, std::shared_ptr<Rendezvous> rendezvous)
    : opts_(opts), rendezvous_(std::move(rendezvous)) {}

GlooBackend::~GlooBackend() = default;

void GlooBackend::connect() {
  if (context_) return;
  // On the worker thread: Gloo's event loop inherits its blocked SIGPIPE.
  executor_.submit([this] { connectHere(); }).get().throwIfFailed();
}

void GlooBackend::connectHere() {
  store_ = rendezvous_->store();
  glooCall("connect", [&] {
    gloo::transport::tcp::attr attr(localHostname(opts_).c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(opts_.rank, opts_.world_size);
    context->setTimeout(std::chrono::milliseconds(opts_.timeout_ms));
    context->connectFullMesh(*store_, device);
    context_ = context;
  });
}

std::unique_ptr<Work> GlooBackend::startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                                  ReduceSpec spec) {
  connect();
  auto context = context_;
  auto task = [context, data, numel, dtype, spec] {
    if (spec.prescale != 1.0) scaleInPlace(data, numel, dtype, spec.prescale);
    glooCall("allreduce", [&] {
      gloo::AllreduceOptions opts(context);
      switch (dtype) {
        case SF_DTYPE_FLOAT32:
          setBuffer<float>(opts, data, numel);
          opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
              &gloo::sum<float>));
          break;
        case SF_DTYPE_FLOAT64:
          setBuffer<double>(opts, data, numel);
          opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
              &gloo::sum<double>));
          break;
        default:  // 16-bit floats: our own conversion-based sum
          setBuffer<uint16_t>(opts, data, numel);
          opts.setReduceFunction([dtype](void* c, const void* a, const void* b, size_t n) {
            addInto(c, a, b, n, dtype);
          });
          break;
      }
      gloo::allreduce(opts);
    });
    if (spec.postscale != 1.0) scaleInPlace(data, numel, dtype, spec.postscale);
  };
  return std::make_unique<GlooWork>(executor_.submit(task),
                                    std::chrono::milliseconds(opts_.timeout_ms));
}

void GlooBackend::allreduceMaxInt64(int64_t* data, int64_t n) {
  connect();
  auto context = context_;
  executor_
      .submit([context, data, n] {
        glooCall("allreduce (layout check)", [&] {
          gloo::AllreduceOptions opts(context);
          opts.setOutput(data, size_t(n));
          opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
              &gloo::max<int64_t>));
          gloo::allreduce(opts);
        });
      })
      .get()
      .throwIfFailed();
}

void GlooBackend::barrierQuietly() noexcept {
  if (!context_) return;
  try {
    auto context = context_;
    const auto timeout = std::chrono::milliseconds(std::min<int64_t>(opts_.timeout_ms, 10000));
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

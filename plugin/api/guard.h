#pragma once
// The C boundary: every extern "C" entry point is one line through guard(),
// which turns any exception into a status and the thread's last-error
// message ("function: what went wrong").

#include <exception>
#include <new>
#include <string>

#include "plugin/orchestrator/context.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "sfsync.h"

namespace sfsync {

void setLastError(const char* function, const char* message) noexcept;

// Logs the call at TRACE (one relaxed load when TRACE is off) and each
// failure at INFO.
template <typename F>
sf_status guard(const char* function, F&& body) noexcept {
  if (__builtin_expect(logEnabled(LogLevel::kTrace), 0)) logWrite(LogLevel::kTrace, "api", function);
  sf_status status;
  try {
    body();
    return SF_OK;
  } catch (const Error& e) {
    setLastError(function, e.what());
    status = e.status();
  } catch (const std::bad_alloc&) {
    setLastError(function, "out of memory");
    status = SF_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    setLastError(function, e.what());
    status = SF_ERR_INTERNAL;
  } catch (...) {
    setLastError(function, "unknown exception");
    status = SF_ERR_INTERNAL;
  }
  SF_LOG(kInfo, "api", "status " << status << ": " << sf_last_error());
  return status;
}

// A non-NULL pointer argument, or SF_ERR_INVALID_ARGUMENT naming it.
template <typename T>
T& checked(T* p, const char* what = "ctx") {
  if (!p) fail(SF_ERR_INVALID_ARGUMENT, std::string(what) + " is NULL");
  return *p;
}

}  // namespace sfsync

// The opaque handle is the C++ context itself.
struct sf_context : sfsync::Context {
  using sfsync::Context::Context;
};

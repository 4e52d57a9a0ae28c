#pragma once
// Errors inside the plugin: one exception type that carries the ABI status.
// Everything thrown inside becomes a status and a message at the C boundary
// (api/guard.h); nothing else is allowed to escape.

#include <stdexcept>
#include <string>

#include "sfsync.h"

namespace sfsync {

class Error : public std::runtime_error {
 public:
  Error(sf_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  sf_status status() const { return status_; }

 private:
  sf_status status_;
};

// Builds "argument 'name' = value: reason" style messages in one expression.
[[noreturn]] void fail(sf_status status, const std::string& message);

}  // namespace sfsync

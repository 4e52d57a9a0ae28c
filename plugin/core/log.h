#pragma once
// The one logger of sfsync (library, shim, tools, Python package through
// sf_log). Lines are shaped like NCCL_DEBUG's:
//   sfsync <host>:<pid>:<rank> <LEVEL> <subsystem> message
// SF_DEBUG = WARN (default) | INFO | TRACE | NONE selects the level;
// SF_DEBUG_FILE = path (%h host, %p pid, %r rank substituted) sends the lines
// to a file instead of stderr. Not responsible for deciding what is worth
// saying: callers choose the level.

#include <sstream>
#include <string>

namespace sfsync {

enum class LogLevel : int { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

// Whether `level` is printed: one relaxed atomic load after the first call.
bool logEnabled(LogLevel level) noexcept;
// Writes one line (a trailing newline is added). Never throws.
void logWrite(LogLevel level, const char* subsystem, const std::string& message) noexcept;
// The rank shown in each line (-1, the default, prints RANK from the
// environment if set, else '-').
void logSetRank(int rank) noexcept;
// Re-reads SF_DEBUG and SF_DEBUG_FILE (tests).
void logReconfigure() noexcept;

}  // namespace sfsync

// SF_LOG(kInfo, "store", "listening on " << port): the message is only built
// when the level is enabled.
#define SF_LOG(level, subsystem, expr)                                         \
  do {                                                                         \
    if (::sfsync::logEnabled(::sfsync::LogLevel::level)) {                     \
      std::ostringstream sf_log_stream_;                                       \
      sf_log_stream_ << expr;                                                  \
      ::sfsync::logWrite(::sfsync::LogLevel::level, subsystem,                 \
                         sf_log_stream_.str());                                \
    }                                                                          \
  } while (0)

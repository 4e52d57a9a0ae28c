#pragma once
// The parameter table: every SF_* environment variable that sfsync's
// libraries read (libsfsync.so, the NCCL module, the shim), declared once
// with its type, its default and one line of documentation, as NCCL's
// NCCL_PARAM table does. Each is read in one place, through env.h.
// tests/unit/core/params_tests.cpp checks the table against docs/launchers.md's
// Environment section (both ways) and against the sources (every "SF_*"
// name literal under plugin/ and shim/ is declared here). Adding a variable:
// a row here, a row in docs/launchers.md, then read it through env.h.

#include <cstddef>

namespace sfsync {

struct Param {
  const char* name;          // "SF_TIMEOUT_MS"
  const char* type;          // int, ms, number, choice, text, path, flag, level
  const char* defaultValue;  // as documented ("unset": no default)
  const char* doc;           // one line
  const char* readBy;        // the file that reads it
};

// The table, in docs/launchers.md's order.
const Param* params(size_t* count);
// The row of `name`, or nullptr.
const Param* findParam(const char* name);

}  // namespace sfsync

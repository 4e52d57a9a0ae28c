#pragma once
// SF_STRICT: misuse that sfsync can only warn about (windows that affect
// nothing, a window the shim sees growing, a refused sf_begin_accumulation)
// becomes an error where it is seen. Read once per process, here only; the
// shim gets it through plugin/api/sfsync_internal.h.

namespace sfsync {

// SF_STRICT = 1 | true | yes: true; unset, empty, 0, false, no: false;
// anything else: false, said once at WARN.
bool strictMode() noexcept;

}  // namespace sfsync

#pragma once
// A Python host under the shim: its DDPs' windows are followed in-process,
// where the host's no_sync() and its optimizer step can be seen (sfsync.torch's
// no-code path, python/sfsync/follow_boot.py), which then tells the shim to
// pass every call (sf_shim_follow_in_process, shim_instance.h). Set up once,
// when the shim is loaded, before the interpreter reads its environment.

namespace sfshim {

// At load: in a Python interpreter (it defines Py_Main) unless
// SF_FOLLOW_HOST=0, find sfsync's boot folder (next to the shim in an
// installed package, else the source tree's python/sfsync/_boot), put it
// first on PYTHONPATH, set SF_FOLLOW_HOST=1 and, unless set, SFSYNC_LIBRARY
// to the libsfsync.so.1 the shim loaded (one instance, one default
// context). Said at INFO; a Python host whose boot folder is missing is
// said at WARN and keeps the shim's own windows.
void handPythonHost();

}  // namespace sfshim

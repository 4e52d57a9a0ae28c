#!/usr/bin/python3
"""What libsfsync.so itself says about windows, at the call where it is seen.

Usage: window_warnings.py LIBSFSYNC_SO LIBSFSYNC_SHIM_SO

Each case runs in a fresh process (the logger and SF_STRICT are read once per
process) that loads libsfsync.so with ctypes, as a Python host does, with
SF_DEBUG_FILE set; the host writes its own marker lines through sf_log, so the
order of the lines in the file shows where each warning came from:

  nothing       no shim, no gradient: the first sf_end_accumulation says that
                these windows affect nothing, once (not at the second window).
  strict        the same with SF_STRICT=1: that sf_end_accumulation fails
                (SF_ERR_INVALID_STATE), the window is ended all the same.
  shim          the shim preloaded: it follows the default context: silent.
  registered    a gradient registered with the context: silent.
  asked         the host asks sf_in_accumulation (a DDP comm hook does): silent.
  forgot        sf_begin_accumulation twice: refused, and said at that call.
  not_made      the private interface (sf_internal_window_state_v1) reports the
                default context as not made, and reading it does not make it.
"""

import ctypes
import os
import subprocess
import sys
import tempfile

SF_OK, SF_ERR_INVALID_STATE = 0, 2


class State(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint64), ("context_made", ctypes.c_int32),
                ("in_window", ctypes.c_int32), ("windows_begun", ctypes.c_int64),
                ("windows_ended", ctypes.c_int64), ("refused_begins", ctypes.c_int64),
                ("refused_begin_window", ctypes.c_int64), ("gradients", ctypes.c_int64),
                ("strict", ctypes.c_int32), ("reserved", ctypes.c_int32)]


def child(case, lib):
    sf = ctypes.CDLL(lib)
    sf.sf_last_error.restype = ctypes.c_char_p
    mark = lambda text: sf.sf_log(1, b"host", text.encode())  # WARN: always written
    if case == "not_made":
        s = State(struct_size=ctypes.sizeof(State))
        for _ in range(2):
            assert sf.sf_internal_window_state_v1(None, 0, ctypes.byref(s)) == SF_OK
            assert s.context_made == 0, "reading the state made the default context"
        ctx = ctypes.c_void_p()
        assert sf.sf_default_context(ctypes.byref(ctx)) == SF_OK
        assert sf.sf_begin_accumulation(ctx) == SF_OK
        assert sf.sf_internal_window_state_v1(None, 0, ctypes.byref(s)) == SF_OK
        assert (s.context_made, s.in_window, s.windows_begun) == (1, 1, 1), \
            (s.context_made, s.in_window, s.windows_begun)
        print("state: not made, then made with window 1 open")
        return
    ctx = ctypes.c_void_p()
    assert sf.sf_default_context(ctypes.byref(ctx)) == SF_OK
    if case == "registered":
        buf = (ctypes.c_float * 16)()
        gid = ctypes.c_int64()
        assert sf.sf_register_gradient(ctx, buf, ctypes.c_int64(16), 0, 0, None,
                                       ctypes.byref(gid)) == SF_OK, sf.sf_last_error()
    for w in (1, 2):
        mark(f"begin window {w}")
        assert sf.sf_begin_accumulation(ctx) == SF_OK
        if case == "asked":
            assert sf.sf_in_accumulation(ctx) == 1
        if case == "forgot" and w == 2:
            mark("begin again")
            status = sf.sf_begin_accumulation(ctx)
            assert status == SF_ERR_INVALID_STATE, status
            mark("after begin again")
        mark(f"end window {w}")
        status = sf.sf_end_accumulation(ctx)
        mark(f"ended window {w}: status {status}")
        if case == "strict":
            assert status == SF_ERR_INVALID_STATE, status
            assert b"affected nothing" in sf.sf_last_error(), sf.sf_last_error()
        else:
            assert status == SF_OK, (status, sf.sf_last_error())
        s = State(struct_size=ctypes.sizeof(State))  # not sf_in_accumulation: that follows
        assert sf.sf_internal_window_state_v1(ctx, 0, ctypes.byref(s)) == SF_OK
        assert s.in_window == 0 and s.windows_ended == w, (s.in_window, s.windows_ended)


def run(case, lib, shim, tmp):
    log = os.path.join(tmp, case + ".log")
    env = dict(os.environ, SF_DEBUG_FILE=log, SF_DEBUG="WARN")
    for k in ("SF_STRICT", "LD_PRELOAD", "SF_ACCUMULATION_STEPS"):
        env.pop(k, None)
    if case == "strict":
        env["SF_STRICT"] = "1"
    if case == "shim":
        env["LD_PRELOAD"] = shim
    p = subprocess.run([sys.executable, __file__, "--child", case, lib], env=env,
                       capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        return [f"{case}: child failed ({p.returncode}): {p.stdout}{p.stderr}"]
    lines = open(log).read().splitlines() if os.path.exists(log) else []
    lines = [l.split(" ", 2)[2] for l in lines]  # "LEVEL subsystem message"
    print(f"--- {case}\n  " + "\n  ".join(lines))
    nothing = [i for i, l in enumerate(lines) if "these windows affect nothing" in l]
    refused = [i for i, l in enumerate(lines) if "sf_begin_accumulation inside window 2 refused" in l]
    failures = []

    def at(text):
        return lines.index(text) if text in lines else -1

    if case in ("nothing", "strict"):
        # Once, right after the first end, before anything else of the host.
        want = at("WARN host end window 1") + 1
        if nothing != [want] or want == 0:
            failures.append(f"{case}: 'affect nothing' at lines {nothing}, want [{want}] (once, "
                            f"at the first sf_end_accumulation)")
        if case == "strict" and "SF_STRICT=1: sf_end_accumulation fails" not in lines[want]:
            failures.append(f"{case}: the warning does not say SF_STRICT=1 fails the call")
    elif nothing and case != "forgot":  # forgot: nothing follows its windows either
        failures.append(f"{case}: said 'affect nothing' although the windows are followed")
    if case == "forgot":
        want = at("WARN host begin again") + 1
        if refused != [want] or want == 0 or at("WARN host after begin again") != want + 1:
            failures.append(f"forgot: refused begin said at lines {refused}, want [{want}] "
                            f"(between the host's markers)")
    elif refused:
        failures.append(f"{case}: a refused begin said, but none was refused")
    return failures


def main():
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    lib, shim = sys.argv[1], sys.argv[2]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in ("nothing", "strict", "shim", "registered", "asked", "forgot", "not_made"):
            failures += run(case, lib, shim, tmp)
    for f in failures:
        print("FAILED: " + f, file=sys.stderr)
    if failures:
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()

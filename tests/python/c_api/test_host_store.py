#!/usr/bin/python3
"""sf_set_store from Python: raw ctypes against libsfsync.so (independent of the
sfsync package), with callbacks backed by a real torch.distributed TCPStore, and
ranks as real processes.

Usage: test_host_store.py LIBSFSYNC.so        (runs the unittest suite)
       test_host_store.py LIBSFSYNC.so --rank R --world W --port P --case NAME
                                               (one rank; prints one JSON line)
"""
import ctypes
import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
import unittest

LIB_PATH = None

SF_OK, SF_ERR_INVALID_ARGUMENT, SF_ERR_INVALID_STATE, SF_ERR_MISMATCH = 0, 1, 2, 3
SF_ERR_BACKEND, SF_ERR_TIMEOUT = 4, 5
SF_STORE_OK, SF_STORE_TIMEOUT, SF_STORE_ERROR = 0, 1, 2
SF_DTYPE_FLOAT32, SF_DEVICE_HOST = 0, 0

SET_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
                          ctypes.c_uint64)
GET_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64,
                          ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64))


class SfStore(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint64), ("user", ctypes.c_void_p),
                ("set", SET_FN), ("get", GET_FN)]


class SfOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint64), ("rank", ctypes.c_int32),
                ("world_size", ctypes.c_int32), ("local_rank", ctypes.c_int32),
                ("backend", ctypes.c_int32), ("reduce_op", ctypes.c_int32),
                ("reserved0", ctypes.c_int32), ("prescale", ctypes.c_double),
                ("bucket_cap_mb", ctypes.c_double), ("first_bucket_cap_mb", ctypes.c_double),
                ("timeout_ms", ctypes.c_int64), ("rendezvous", ctypes.c_char * 256)]


def load():
    lib = ctypes.CDLL(LIB_PATH)
    lib.sf_last_error.restype = ctypes.c_char_p
    lib.sf_create.argtypes = [ctypes.POINTER(SfOptions), ctypes.POINTER(ctypes.c_void_p)]
    lib.sf_destroy.argtypes = [ctypes.c_void_p]
    lib.sf_destroy.restype = None
    lib.sf_store_init.argtypes = [ctypes.POINTER(SfStore), ctypes.c_uint64]
    lib.sf_set_store.argtypes = [ctypes.c_void_p, ctypes.POINTER(SfStore), ctypes.c_char_p]
    lib.sf_connect.argtypes = [ctypes.c_void_p]
    lib.sf_register_gradient.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p,
                                         ctypes.POINTER(ctypes.c_int64)]
    lib.sf_synchronize.argtypes = [ctypes.c_void_p]
    lib.sf_broadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32]
    lib.sf_digest.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                              ctypes.POINTER(ctypes.c_uint64)]
    lib.sf_check_replicas.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    return lib


class TorchStoreCallbacks:
    """sf_store callbacks over a torch.distributed store. Keeps the ctypes
    function objects alive as long as itself. Exceptions never reach ctypes
    (which would print them and return 0, i.e. SF_STORE_OK)."""

    def __init__(self, store):
        self.store = store
        self.calls = {"set": 0, "get": 0}
        self._lock = threading.Lock()
        self.keys = set()
        self._set = SET_FN(self.set)
        self._get = GET_FN(self.get)

    def set(self, _user, key, value, nbytes):
        try:
            with self._lock:
                self.calls["set"] += 1
                self.keys.add(key.decode())
                self.store.set(key.decode(), ctypes.string_at(value, nbytes) if nbytes else b"")
                self.store.add(key.decode() + "/set", 1)
            return SF_STORE_OK
        except Exception:
            return SF_STORE_ERROR

    def get(self, _user, key, timeout_ms, buf, capacity, out_bytes):
        try:
            k = key.decode()
            # torch 1.13's TCPStore client is one socket, not thread-safe
            # (sfsync calls from several threads: one lock), and a wait()
            # that times out leaves its late reply in the socket for the next
            # request (a chance hang seen in CI): never wait with a timeout;
            # poll a counter key that set() bumps (add() answers at once).
            # A zero timeout means "look, do not wait".
            deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
            pause = 0.0005
            while True:
                with self._lock:
                    self.calls["get"] += 1
                    if self.store.add(k + "/set", 0) > 0:
                        value = self.store.get(k)
                        break
                if time.monotonic() >= deadline:
                    return SF_STORE_TIMEOUT
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
        except RuntimeError as e:
            return SF_STORE_TIMEOUT if "imeout" in str(e) else SF_STORE_ERROR
        except Exception:
            return SF_STORE_ERROR
        out_bytes[0] = len(value)
        if len(value) <= capacity:
            ctypes.memmove(buf, value, len(value))
        return SF_STORE_OK

    def struct(self, lib):
        s = SfStore()
        assert lib.sf_store_init(ctypes.byref(s), ctypes.sizeof(s)) == SF_OK
        s.set, s.get = self._set, self._get
        return s


def rank_main(args):
    """One rank: prints a JSON line with what happened."""
    import torch.distributed as dist
    rank, world, port, case = args.rank, args.world, args.port, args.case
    lib = load()
    out = {"rank": rank, "steps": []}

    def step(name, status):
        out["steps"].append([name, status, lib.sf_last_error().decode() if status else ""])
        return status == SF_OK

    store = dist.TCPStore("127.0.0.1", port, None, rank == 0 and not args.client_only,
                          datetime.timedelta(seconds=30), wait_for_workers=False)
    cb = TorchStoreCallbacks(store)
    o = SfOptions()
    lib.sf_options_init(ctypes.byref(o), ctypes.c_uint64(ctypes.sizeof(o)))
    o.rank, o.world_size, o.timeout_ms, o.rendezvous = rank, world, args.timeout_ms, b"host://"
    ctx = ctypes.c_void_p()
    t0 = time.monotonic()
    try:
        if not step("create", lib.sf_create(ctypes.byref(o), ctypes.byref(ctx))):
            return out
        s = cb.struct(lib)
        if not step("set_store", lib.sf_set_store(ctx, ctypes.byref(s), b"pyjob")):
            return out
        status = lib.sf_connect(ctx)
        out["connect_seconds"] = time.monotonic() - t0
        if not step("connect", status) or case != "train":
            return out
        n = 1001
        grad = (ctypes.c_float * n)(*[float(rank + 1) * (i % 7) for i in range(n)])
        gid = ctypes.c_int64()
        step("register", lib.sf_register_gradient(ctx, grad, n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST,
                                                  b"w", ctypes.byref(gid)))
        step("synchronize", lib.sf_synchronize(ctx))
        out["grad_sample"] = [grad[0], grad[1], grad[6], grad[1000]]
        weights = (ctypes.c_ubyte * 4099)(*[(i * 13 + rank) & 255 for i in range(4099)])
        step("broadcast", lib.sf_broadcast(ctx, weights, 4099, 1))
        out["weights_sum"] = sum(weights)
        digest = ctypes.c_uint64()
        lib.sf_digest(weights, 4099, 0, ctypes.byref(digest))
        step("check_equal", lib.sf_check_replicas(ctx, digest.value))
        if rank == 1:
            weights[2000] ^= 0x10
        lib.sf_digest(weights, 4099, 0, ctypes.byref(digest))
        step("check_flipped", lib.sf_check_replicas(ctx, digest.value))
        out["calls"] = cb.calls
        out["keys"] = sorted(cb.keys)
        return out
    finally:
        if ctx:
            lib.sf_destroy(ctx)
        # Rank 0 serves the TCPStore: it stays until every process is done
        # with it (a late second claimant still needs it to be refused).
        store.add("finished", 1)
        deadline = time.monotonic() + 30
        while rank == 0 and not args.client_only and time.monotonic() < deadline:
            if store.add("finished", 0) >= args.procs:
                break
            time.sleep(0.05)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks, world, case, timeout_ms=20000, wait_s=60):
    """Starts one process per entry of `ranks` (rank 0 first: it serves the
    TCPStore) and returns their JSON results, in order."""
    port = free_port()
    procs = []
    for i, r in enumerate(ranks):
        cmd = [sys.executable, os.path.abspath(__file__), LIB_PATH, "--rank", str(r), "--world",
               str(world), "--port", str(port), "--case", case, "--timeout-ms", str(timeout_ms)]
        cmd += ["--procs", str(len(ranks))]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        if i == 0:
            time.sleep(0.3)  # the TCPStore server first
    results = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung past %d s" % wait_s)
        lines = [l for l in so.splitlines() if l.startswith("{")]
        assert p.returncode == 0 and lines, "rank failed: rc=%d\n%s\n%s" % (p.returncode, so, se)
        results.append(json.loads(lines[-1]))
    return results


def steps(result):
    return {name: (status, msg) for name, status, msg in result["steps"]}


class HostStoreFromPython(unittest.TestCase):
    def test_two_processes_sync_broadcast_and_check_through_a_torch_tcpstore(self):
        results = launch([0, 1], 2, "train")
        for r, res in enumerate(results):
            st = steps(res)
            for name in ("create", "set_store", "connect", "register", "synchronize",
                         "broadcast", "check_equal"):
                self.assertEqual(st[name][0], SF_OK, "rank %d %s: %s" % (r, name, st[name][1]))
            # Average of (rank + 1) * (i % 7) over ranks 1 and 2: 1.5 * (i % 7).
            self.assertEqual(res["grad_sample"], [0.0, 1.5, 9.0, 1.5 * (1000 % 7)])
            # Rank 1's bytes everywhere.
            self.assertEqual(res["weights_sum"], sum((i * 13 + 1) & 255 for i in range(4099)))
            status, msg = st["check_flipped"]
            self.assertEqual(status, SF_ERR_MISMATCH, msg)
            self.assertIn("replicas differ: rank 1 of 2", msg)
            self.assertGreaterEqual(res["calls"]["set"], 2)
            for k in res["keys"]:
                self.assertTrue(k.startswith("pyjob/sfsync/"), k)
        self.assertIn("pyjob/sfsync/roster", results[0]["keys"])

    def test_missing_rank_times_out_within_timeout_plus_slack(self):
        (res,) = launch([0], 2, "connect", timeout_ms=2000)
        status, msg = steps(res)["connect"]
        self.assertEqual(status, SF_ERR_TIMEOUT, msg)
        self.assertIn("rank 1 of world_size 2 did not join", msg)
        self.assertGreaterEqual(res["connect_seconds"], 1.9)
        self.assertLess(res["connect_seconds"], 2.0 + 3.0)  # documented slack

    def test_two_processes_claiming_rank_1_are_refused(self):
        results = launch([0, 1, 1], 2, "connect", timeout_ms=8000)
        statuses = [steps(r)["connect"] for r in results]
        refused = [s for s in statuses if s[0] == SF_ERR_MISMATCH]
        self.assertGreaterEqual(len(refused), 1, statuses)
        for status, msg in statuses:
            self.assertIn(status, (SF_OK, SF_ERR_MISMATCH), msg)
            if status == SF_ERR_MISMATCH:
                self.assertIn("rank 1 is claimed by two processes", msg)
        ok = [s for s in statuses if s[0] == SF_OK]
        self.assertIn(len(ok), (0, 2), statuses)  # the whole job, or rank 0 and one claimant

    def test_store_errors_become_statuses(self):
        import torch.distributed as dist
        lib = load()
        store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5),
                              wait_for_workers=False)

        class Failing(TorchStoreCallbacks):
            def set(self, *a):
                try:
                    raise ConnectionError("store went away")
                except Exception:
                    return SF_STORE_ERROR

        cb = Failing(store)
        o = SfOptions()
        lib.sf_options_init(ctypes.byref(o), ctypes.c_uint64(ctypes.sizeof(o)))
        o.rank, o.world_size, o.timeout_ms, o.rendezvous = 1, 2, 3000, b"host://"
        ctx = ctypes.c_void_p()
        self.assertEqual(lib.sf_create(ctypes.byref(o), ctypes.byref(ctx)), SF_OK)
        s = cb.struct(lib)
        self.assertEqual(lib.sf_set_store(ctx, ctypes.byref(s), b"err"), SF_OK)
        self.assertEqual(lib.sf_connect(ctx), SF_ERR_BACKEND)
        self.assertIn("set of key 'err/sfsync/join/1' failed", lib.sf_last_error().decode())
        lib.sf_destroy(ctx)


if __name__ == "__main__":
    LIB_PATH = sys.argv[1]
    if "--rank" in sys.argv:
        import argparse
        p = argparse.ArgumentParser()
        p.add_argument("lib")
        p.add_argument("--rank", type=int)
        p.add_argument("--world", type=int)
        p.add_argument("--port", type=int)
        p.add_argument("--case")
        p.add_argument("--timeout-ms", type=int, default=20000)
        p.add_argument("--client-only", action="store_true")
        p.add_argument("--procs", type=int, default=1)
        print(json.dumps(rank_main(p.parse_args())), flush=True)
    else:
        unittest.main(argv=[sys.argv[0], "-v"])

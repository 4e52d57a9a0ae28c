"""The one binding of include/sfsync.h: its constants, every structure and
every function, each once, with the sfsync version that added it ("Since").
The rest of the package (``sfsync``, ``sfsync.shard``, ``sfsync.launch``,
``sfsync.torch``) calls the library only through what ``sfsync.lib()`` binds
from the tables here; nothing else declares an argtype.

``tests/python/sfsync/test_binding.py`` reads the header and checks this module
against it: every function's name, return type, argument count and types
and Since version, every struct's fields, size and offsets (through the C
compiler's view, ``tests/python/support/layout_probe.c``), every ``#define``'d
constant.

Standard library only.
"""

import ctypes
from collections import namedtuple

#: The SF_ABI_VERSION this module mirrors (include/sfsync.h).
ABI_VERSION = 1

# ---- Constants (include/sfsync.h; never renumbered) ------------------------

OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_INVALID_STATE = 2
ERR_MISMATCH = 3
ERR_BACKEND = 4
ERR_TIMEOUT = 5
ERR_UNSUPPORTED = 6
ERR_OUT_OF_MEMORY = 7
ERR_INTERNAL = 8

DTYPE_FLOAT32 = 0
DTYPE_FLOAT64 = 1
DTYPE_FLOAT16 = 2
DTYPE_BFLOAT16 = 3

DEVICE_HOST = 0
DEVICE_CUDA = 1

REDUCE_AVERAGE = 0
REDUCE_SUM = 1
REDUCE_PRESCALED_SUM = 2
REDUCE_WEIGHTED = 3  # since 0.4: sum / the window's global weight

BACKEND_AUTO = 0
BACKEND_GLOO = 1
BACKEND_NCCL = 2

SHARD_NONE = 0       # since 0.3
SHARD_FLAT = 1
SHARD_PARAMETER = 2

BUCKET_IDLE = 0      # since 0.5: sf_bucket_state's values
BUCKET_FILLING = 1
BUCKET_REDUCING = 2
BUCKET_REDUCED = 3
BUCKET_GATHERING = 4
BUCKET_GATHERING_GRADIENTS = 5
BUCKET_GATHERED = 6

WINDOW_SYNCHRONIZING = 1    # since 0.5: sf_window_state's flags
WINDOW_GRADIENTS_WHOLE = 2

RENDEZVOUS_MAX = 256

LOG_NONE = 0
LOG_WARN = 1
LOG_INFO = 2
LOG_TRACE = 3

#: Float64 window sums per window, and the slots' conventional uses (Since 0.4).
WINDOW_SUMS = 4
WINDOW_SUM_LOSS = 0       # the loss summed over the window's tokens
WINDOW_SUM_TOKENS = 1     # the tokens (or samples) counted
WINDOW_SUM_FOUND_INF = 2  # 1 where a rank found an inf/NaN
WINDOW_SUM_USER = 3       # the host's own metric

STORE_OK = 0
STORE_TIMEOUT = 1
STORE_ERROR = 2

# ---- Structs (exact mirrors: same field order and C types) ------------------


class Options(ctypes.Structure):
    """sf_options. Fill with ``options()`` (sf_options_init), never by hand."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("local_rank", ctypes.c_int32),
        ("backend", ctypes.c_int32),
        ("reduce_op", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
        ("prescale", ctypes.c_double),
        ("bucket_cap_mb", ctypes.c_double),
        ("first_bucket_cap_mb", ctypes.c_double),
        ("timeout_ms", ctypes.c_int64),
        ("rendezvous", ctypes.c_char * RENDEZVOUS_MAX),
        ("max_inflight", ctypes.c_int32),  # since 0.2
        ("wire_dtype", ctypes.c_int32),    # since 0.2
        ("shard_layout", ctypes.c_int32),  # since 0.3
        ("reserved1", ctypes.c_int32),     # since 0.3
    ]

    def to_dict(self):
        """Every field but struct_size and reserved0; rendezvous as str."""
        out = {}
        for name, _ in self._fields_:
            if name in ("struct_size", "reserved0", "reserved1"):
                continue
            value = getattr(self, name)
            out[name] = value.decode() if isinstance(value, bytes) else value
        return out


class Stats(ctypes.Structure):
    """sf_stats: counters since the context was created."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("windows_begun", ctypes.c_int64),
        ("windows_completed", ctypes.c_int64),
        ("deferred_passes", ctypes.c_int64),
        ("deferred_ready_calls", ctypes.c_int64),
        ("collectives_issued", ctypes.c_int64),
        ("early_launches", ctypes.c_int64),
        ("bytes_reduced", ctypes.c_int64),
        ("bucket_count", ctypes.c_int64),
        ("largest_bucket_bytes", ctypes.c_int64),
        ("smallest_bucket_bytes", ctypes.c_int64),
        ("gradient_count", ctypes.c_int64),
        ("gradient_bytes", ctypes.c_int64),
        ("sync_ns_total", ctypes.c_int64),
        ("reduce_scatters", ctypes.c_int64),  # since 0.3
        ("all_gathers", ctypes.c_int64),      # since 0.3
        ("bytes_gathered", ctypes.c_int64),   # since 0.3
        # Since 0.5: what went on the wire, by kind and by purpose (sfsync.h).
        ("wire_allreduces", ctypes.c_int64),
        ("wire_reduce_scatters", ctypes.c_int64),
        ("wire_all_gathers", ctypes.c_int64),
        ("wire_broadcasts", ctypes.c_int64),
        ("wire_controls", ctypes.c_int64),
        ("wire_bytes", ctypes.c_int64),
        ("wire_gradient_bytes", ctypes.c_int64),
        ("wire_parameter_bytes", ctypes.c_int64),
        ("wire_mask_bytes", ctypes.c_int64),
        ("wire_check_bytes", ctypes.c_int64),
        ("wire_weight_bytes", ctypes.c_int64),
        ("wire_host_bytes", ctypes.c_int64),
    ]

    def to_dict(self):
        """Every counter (all fields but struct_size) as a dict of ints."""
        return {name: int(getattr(self, name)) for name, _ in self._fields_
                if name != "struct_size"}


#: The keys of Context.stats().
STATS_KEYS = tuple(name for name, _ in Stats._fields_ if name != "struct_size")


#: int32_t (*set)(void* user, const char* key, const void* value, uint64_t bytes)
STORE_SET_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
                                ctypes.c_uint64)
#: int32_t (*get)(void* user, const char* key, int64_t timeout_ms, void* buffer,
#:                uint64_t capacity, uint64_t* bytes)
STORE_GET_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64,
                                ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64))


class Store(ctypes.Structure):
    """sf_store: the host's key-value store as two callbacks (Since 0.2).
    Fill with sf_store_init; ``Context.set_store`` builds one from Python
    callables."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("user", ctypes.c_void_p),
        ("set", STORE_SET_FN),
        ("get", STORE_GET_FN),
    ]


#: Sizes of the sf_launch_info text fields (Since 0.4).
LAUNCH_TEXT_MAX = 1024
LAUNCHER_NAME_MAX = 16


class LaunchInfo(ctypes.Structure):
    """sf_launch_info (Since 0.4): what sf_discover_launcher reports, the
    launcher discovery behind sf_options_init. Text fields are bytes."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("local_rank", ctypes.c_int32),
        ("truncated", ctypes.c_int32),
        ("launcher", ctypes.c_char * LAUNCHER_NAME_MAX),
        ("rank_vars", ctypes.c_char * LAUNCH_TEXT_MAX),
        ("rendezvous", ctypes.c_char * RENDEZVOUS_MAX),
        ("meeting", ctypes.c_char * LAUNCH_TEXT_MAX),
        ("error", ctypes.c_char * LAUNCH_TEXT_MAX),
        ("unmet", ctypes.c_char * LAUNCH_TEXT_MAX),
    ]


class _ContextStruct(ctypes.Structure):
    """The opaque struct sf_context: only ever handled through a pointer."""


_ContextPtr = ctypes.POINTER(_ContextStruct)


#: Every struct of include/sfsync.h: C name -> (binding, Since).
STRUCTS = {
    "sf_options": (Options, "0.1"),
    "sf_stats": (Stats, "0.1"),
    "sf_store": (Store, "0.2"),
    "sf_launch_info": (LaunchInfo, "0.4"),
}

# ---- Functions --------------------------------------------------------------

#: An int32_t sf_status: the binding raises an SfError subclass instead of
#: returning a non-zero one.
_STATUS = "sf_status"

#: One function: return type, argument types (ctypes; _STATUS for sf_status),
#: and the sfsync version that added it.
Prototype = namedtuple("Prototype", "restype argtypes since")

_c = ctypes
_P = _ContextPtr


def _fn(restype, argtypes, since="0.1"):
    return Prototype(restype, list(argtypes), since)


#: Every function of include/sfsync.h, once, in the header's order.
PROTOTYPES = {
    "sf_abi_version": _fn(_c.c_int32, []),
    "sf_version_number": _fn(_c.c_int32, []),
    "sf_version_string": _fn(_c.c_char_p, []),
    "sf_status_string": _fn(_c.c_char_p, [_STATUS]),
    "sf_last_error": _fn(_c.c_char_p, []),
    "sf_options_init": _fn(_STATUS, [_c.POINTER(Options), _c.c_uint64]),
    "sf_create": _fn(_STATUS, [_c.POINTER(Options), _c.POINTER(_P)]),
    "sf_destroy": _fn(None, [_P]),
    "sf_default_context": _fn(_STATUS, [_c.POINTER(_P)]),
    "sf_get_options": _fn(_STATUS, [_P, _c.POINTER(Options)]),
    "sf_set_bucket_cap_mb": _fn(_STATUS, [_P, _c.c_double]),
    "sf_set_first_bucket_cap_mb": _fn(_STATUS, [_P, _c.c_double]),
    "sf_register_gradient": _fn(_STATUS, [_P, _c.c_void_p, _c.c_int64, _c.c_int32, _c.c_int32,
                                          _c.c_char_p, _c.POINTER(_c.c_int64)]),
    "sf_add_gradient": _fn(_STATUS, [_P, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_char_p,
                                     _c.POINTER(_c.c_int64)]),
    "sf_build_buckets": _fn(_STATUS, [_P]),
    "sf_gradient_data": _fn(_STATUS, [_P, _c.c_int64, _c.POINTER(_c.c_void_p)]),
    "sf_zero_gradients": _fn(_STATUS, [_P]),
    "sf_begin_accumulation": _fn(_STATUS, [_P]),
    "sf_end_accumulation": _fn(_STATUS, [_P]),
    "sf_in_accumulation": _fn(_c.c_int32, [_P]),
    "sf_grad_ready": _fn(_STATUS, [_P, _c.c_int64]),
    "sf_synchronize": _fn(_STATUS, [_P]),
    "sf_get_stats": _fn(_STATUS, [_P, _c.POINTER(Stats)]),
    "sf_bucket_info": _fn(_STATUS, [_P, _c.c_int64, _c.POINTER(_c.c_int64),
                                    _c.POINTER(_c.c_int64), _c.POINTER(_c.c_int32)]),
    "sf_bucket_state": _fn(_STATUS, [_P, _c.c_int64, _c.POINTER(_c.c_int32)], "0.5"),
    "sf_window_state": _fn(_STATUS, [_P, _c.POINTER(_c.c_int32)], "0.5"),
    "sf_count_window": _fn(_STATUS, [_P], "0.5"),
    "sf_restore_windows": _fn(_STATUS, [_P, _c.c_int64], "0.4"),
    "sf_add_window_weight": _fn(_STATUS, [_P, _c.c_double], "0.4"),
    "sf_add_window_sums": _fn(_STATUS, [_P, _c.POINTER(_c.c_double), _c.c_int32], "0.4"),
    "sf_get_window_totals": _fn(_STATUS, [_P, _c.POINTER(_c.c_double), _c.POINTER(_c.c_double),
                                          _c.c_int32], "0.4"),
    "sf_backend_available": _fn(_STATUS, [_c.c_int32]),
    "sf_set_cuda_stream": _fn(_STATUS, [_P, _c.c_void_p]),
    "sf_adopt_nccl_comm": _fn(_STATUS, [_P, _c.c_void_p]),
    "sf_log_level": _fn(_c.c_int32, [], "0.2"),
    "sf_log": _fn(None, [_c.c_int32, _c.c_char_p, _c.c_char_p], "0.2"),
    "sf_store_init": _fn(_STATUS, [_c.POINTER(Store), _c.c_uint64], "0.2"),
    "sf_set_store": _fn(_STATUS, [_P, _c.POINTER(Store), _c.c_char_p], "0.2"),
    "sf_connect": _fn(_STATUS, [_P], "0.2"),
    "sf_broadcast": _fn(_STATUS, [_P, _c.c_void_p, _c.c_uint64, _c.c_int32], "0.2"),
    "sf_digest": _fn(_STATUS, [_c.c_void_p, _c.c_uint64, _c.c_uint64, _c.POINTER(_c.c_uint64)],
                     "0.2"),
    "sf_digest_gradients": _fn(_STATUS, [_P, _c.POINTER(_c.c_uint64)], "0.2"),
    "sf_check_replicas": _fn(_STATUS, [_P, _c.c_uint64], "0.2"),
    "sf_set_shard_layout": _fn(_STATUS, [_P, _c.c_int32], "0.3"),
    "sf_register_parameter": _fn(_STATUS, [_P, _c.c_int64, _c.c_void_p, _c.c_int64, _c.c_int32,
                                           _c.c_int32], "0.3"),
    "sf_parameter_data": _fn(_STATUS, [_P, _c.c_int64, _c.POINTER(_c.c_void_p)], "0.3"),
    "sf_shard_range": _fn(_STATUS, [_P, _c.c_int64, _c.POINTER(_c.c_int64),
                                    _c.POINTER(_c.c_int64)], "0.3"),
    "sf_gradient_bucket": _fn(_STATUS, [_P, _c.c_int64, _c.POINTER(_c.c_int64)], "0.3"),
    "sf_synchronize_start": _fn(_STATUS, [_P], "0.3"),
    "sf_wait_bucket": _fn(_STATUS, [_P, _c.c_int64], "0.3"),
    "sf_start_gather": _fn(_STATUS, [_P, _c.c_int64], "0.3"),
    "sf_wait_gather": _fn(_STATUS, [_P, _c.c_int64], "0.3"),
    "sf_gather_parameters": _fn(_STATUS, [_P], "0.3"),
    "sf_gather_gradients": _fn(_STATUS, [_P], "0.4"),
    "sf_allreduce_float64": _fn(_STATUS, [_P, _c.POINTER(_c.c_double), _c.c_int64], "0.3"),
    "sf_discover_launcher": _fn(_STATUS, [_c.POINTER(LaunchInfo), _c.c_uint64,
                                          _c.POINTER(_c.c_char_p)], "0.4"),
}

#: The names of the bound functions (the ABI: tests compare with the header).
FUNCTIONS = tuple(sorted(PROTOTYPES))


def since(version):
    """The functions added in ``version`` ("0.2", ...)."""
    return tuple(name for name, p in PROTOTYPES.items() if p.since == version)


#: What ``from sfsync._abi import *`` gives the package: the header's
#: constants, structs and tables (private helpers stay here).
__all__ = sorted(n for n in list(globals()) if not n.startswith("_") and
                 (n.isupper() or n in ("Options", "Stats", "Store", "LaunchInfo", "Prototype")))

"""The Pythonic layer over the binding: ``Context`` (an sf_context: its gradients
as numpy views, the window as a context manager, stats as a dict, the host's
key-value store as two Python callables), ``options()`` and ``digest()``.

Responsible for: the context's lifetime and every call on it. Not
responsible for: loading and errors (loader.py, errors.py), the declarations
(_abi.py), what a buffer argument may be (buffers.py), torch (sfsync.torch).
"""

import collections
import contextlib
import ctypes
import weakref

from sfsync._abi import (DEVICE_CUDA, DEVICE_HOST, DTYPE_BFLOAT16, DTYPE_FLOAT16, DTYPE_FLOAT32,
                         DTYPE_FLOAT64, ERR_INTERNAL, ERR_INVALID_ARGUMENT, ERR_INVALID_STATE,
                         ERR_UNSUPPORTED, LOG_WARN, REDUCE_AVERAGE, REDUCE_PRESCALED_SUM,
                         REDUCE_SUM, REDUCE_WEIGHTED, RENDEZVOUS_MAX, SHARD_FLAT, SHARD_NONE,
                         SHARD_PARAMETER, STORE_ERROR, STORE_GET_FN, STORE_OK, STORE_SET_FN,
                         STORE_TIMEOUT, WINDOW_GRADIENTS_WHOLE, WINDOW_SUMS, WINDOW_SYNCHRONIZING,
                         Options, Stats, Store)
from sfsync._abi import _ContextPtr  # the binding's opaque pointer type (see loader.py)
from sfsync.buffers import address_and_size, array_at, digest, dtype_of_array
from sfsync.loader import BACKEND_NAMES, error, lib, loaded, log, prefer_torch_cuda_libraries

__all__ = ["DTYPE_SIZES", "DTYPE_NAMES", "options", "digest", "Context"]

#: Bytes per element of each sf_dtype.
DTYPE_SIZES = {DTYPE_FLOAT32: 4, DTYPE_FLOAT64: 8, DTYPE_FLOAT16: 2, DTYPE_BFLOAT16: 2}
DTYPE_NAMES = {DTYPE_FLOAT32: "float32", DTYPE_FLOAT64: "float64", DTYPE_FLOAT16: "float16",
               DTYPE_BFLOAT16: "bfloat16"}

#: The names options() takes for reduce_op (SF_REDUCE's) and wire_dtype.
REDUCE_NAMES = {"average": REDUCE_AVERAGE, "sum": REDUCE_SUM,
                "prescaled_sum": REDUCE_PRESCALED_SUM, "weighted": REDUCE_WEIGHTED}
#: The name of each sf_shard_layout (SF_SHARD's, GradientSync's shard_layout).
SHARD_NAMES = {SHARD_NONE: "none", SHARD_FLAT: "flat", SHARD_PARAMETER: "parameter"}
#: sf_bucket_state's names, by value (SF_BUCKET_*: never renumbered).
BUCKET_STATE_NAMES = ("idle", "filling", "reducing", "reduced", "gathering",
                      "gathering_gradients", "gathered")
WIRE_NAMES = {"float32": DTYPE_FLOAT32, "fp32": DTYPE_FLOAT32, "float16": DTYPE_FLOAT16,
              "fp16": DTYPE_FLOAT16, "bfloat16": DTYPE_BFLOAT16, "bf16": DTYPE_BFLOAT16}


def _named(table, key, value):
    try:
        return table[value]
    except KeyError:
        raise error(ERR_INVALID_ARGUMENT, "options: %s = %r is not one of %s"
                    % (key, value, ", ".join(sorted(table)))) from None


def _set_fields(opts, overrides):
    for key, value in overrides.items():
        if key in ("struct_size",) or key not in dict(Options._fields_):
            raise TypeError("options: unknown field %r (fields: %s)" % (
                key, ", ".join(n for n, _ in Options._fields_[1:])))
        if key == "rendezvous":
            raw = value.encode() if isinstance(value, str) else bytes(value)
            if len(raw) >= RENDEZVOUS_MAX:
                raise error(ERR_INVALID_ARGUMENT, "options: rendezvous is %d bytes, at most %d "
                             "fit" % (len(raw), RENDEZVOUS_MAX - 1))
            value = raw
        elif key == "backend" and isinstance(value, str):
            value = BACKEND_NAMES[value]
        elif key == "reduce_op" and isinstance(value, str):
            value = _named(REDUCE_NAMES, key, value)
        elif key == "wire_dtype" and isinstance(value, str):
            value = _named(WIRE_NAMES, key, value)
        setattr(opts, key, value)
    return opts


def options(**overrides):
    """An Options filled by sf_options_init (defaults + SF_* / torchrun
    environment), then ``overrides`` (field=value; backend, reduce_op and
    wire_dtype also take their names, e.g. backend="gloo", reduce_op="sum" or
    "weighted", wire_dtype="bfloat16")."""
    opts = Options()
    lib().sf_options_init(ctypes.byref(opts), ctypes.sizeof(opts))
    return _set_fields(opts, overrides)


_Gradient = collections.namedtuple("_Gradient", "numel dtype device name owner")


def _destroy(handle, keep=None):
    """sf_destroy; ``keep`` (the store callbacks) is only released after it."""
    dll = loaded()
    if dll is not None and handle:
        dll.sf_destroy(handle)
    if keep:
        del keep[:]


class Context:
    """An sf_context: one data-parallel group with its gradients and window.

    ``Context(opts=None, **overrides)`` creates one (sf_create) from ``opts``
    (an Options) or from ``options(**overrides)``.  ``Context.default()``
    wraps the process-wide default context (owned by the library: close()
    leaves it alone).

    A context created here is destroyed by close(), by ``with``, or when it is
    garbage collected.  Arrays from gradient_array() keep it alive; after an
    explicit close() they must not be used (their memory is freed).
    """

    def __init__(self, opts=None, **overrides):
        lib()
        if opts is None:
            opts = options(**overrides)
        elif overrides:
            copy = Options()
            ctypes.memmove(ctypes.byref(copy), ctypes.byref(opts), ctypes.sizeof(Options))
            opts = _set_fields(copy, overrides)
        handle = _ContextPtr()
        lib().sf_create(ctypes.byref(opts), ctypes.byref(handle))
        self._init(handle, owned=True)

    def _init(self, handle, owned):
        self._handle = handle
        self._owned = owned
        self._grads = []
        self._keep = []  # store callbacks: alive as long as the context
        self._finalizer = weakref.finalize(self, _destroy, handle, self._keep) if owned else None

    @classmethod
    def default(cls):
        """The process-wide default context (sf_default_context)."""
        lib()
        handle = _ContextPtr()
        lib().sf_default_context(ctypes.byref(handle))
        self = cls.__new__(cls)
        self._init(handle, owned=False)
        return self

    # -- lifetime

    @property
    def handle(self):
        """The raw sf_context* (for calling lib() functions directly)."""
        if self._handle is None:
            raise error(ERR_INVALID_STATE, "sfsync.Context: the context is closed")
        return self._handle

    @property
    def closed(self):
        return self._handle is None

    def close(self):
        """sf_destroy (waits for collectives in flight). Idempotent."""
        if self._handle is None:
            return
        if self._finalizer is not None:
            self._finalizer()  # calls sf_destroy once
        self._handle = None
        self._grads = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        if self._handle is None:
            return "<sfsync.Context closed>"
        o = self.options()
        return "<sfsync.Context rank %d/%d, %d gradients%s>" % (
            o["rank"], o["world_size"], len(self._grads), "" if self._owned else ", default")

    # -- options and buckets

    def options(self):
        """The effective options (sf_get_options) as a dict: bucket_cap_mb
        is the cap the buckets were built with once they are (since 0.5 a
        sharded context with no cap chosen builds with the sharded default,
        sf_set_shard_layout), the cap as set before."""
        return self._options().to_dict()

    def _options(self):
        """sf_get_options as the struct."""
        out = Options()
        out.struct_size = ctypes.sizeof(out)
        lib().sf_get_options(self.handle, ctypes.byref(out))
        return out

    @property
    def shard_layout(self):
        """The name of the context's own shard layout, "none", "flat" or
        "parameter" (sf_options.shard_layout, SF_SHARD, sf_set_shard_layout).
        The context is the setting's one holder, and every sharded-or-not
        question of the package asks it here (or ``sharded``)."""
        layout = self._options().shard_layout
        return SHARD_NAMES.get(layout, layout)

    @property
    def sharded(self):
        """The shard layout is "flat" or "parameter" (not "none")."""
        return self._options().shard_layout != SHARD_NONE

    def set_bucket_cap_mb(self, mb):
        lib().sf_set_bucket_cap_mb(self.handle, mb)

    def set_first_bucket_cap_mb(self, mb):
        lib().sf_set_first_bucket_cap_mb(self.handle, mb)

    # -- gradients

    def register_gradient(self, buffer, numel=None, dtype=None, device=DEVICE_HOST, name=None):
        """sf_register_gradient: a buffer the host owns. ``buffer`` is a
        C-contiguous, writable numpy array (numel and dtype from it; the
        context keeps a reference) or a raw address (int) with ``numel`` and
        ``dtype`` given. Returns the gradient id."""
        owner = None
        if isinstance(buffer, int) or buffer is None:
            address = buffer
            if numel is None or dtype is None:
                raise TypeError("register_gradient: a raw address needs numel and dtype")
        else:
            arr = buffer
            if not (arr.flags["C_CONTIGUOUS"] and arr.flags["WRITEABLE"]):
                raise error(ERR_INVALID_ARGUMENT, "register_gradient: the array must be "
                             "C-contiguous and writable")
            found = dtype_of_array(arr)
            if dtype is not None and dtype != found:
                raise TypeError("register_gradient: dtype %r does not match the array's %s"
                                % (dtype, arr.dtype))
            dtype = found
            if numel is not None and numel != arr.size:
                raise TypeError("register_gradient: numel %d does not match the array's size %d"
                                % (numel, arr.size))
            numel = arr.size
            address = arr.ctypes.data
            owner = arr
        if device == DEVICE_CUDA:
            prefer_torch_cuda_libraries()
        out = ctypes.c_int64(-1)
        lib().sf_register_gradient(self.handle, address, numel, dtype, device,
                                  _name_bytes(name), ctypes.byref(out))
        self._remember(out.value, _Gradient(numel, dtype, device, name, owner))
        return out.value

    def add_gradient(self, numel, dtype=DTYPE_FLOAT32, device=DEVICE_HOST, name=None):
        """sf_add_gradient: a gradient stored in the plugin's flat buffer.
        Returns its id; get the memory with gradient_array() once all are added."""
        if device == DEVICE_CUDA:
            prefer_torch_cuda_libraries()
        out = ctypes.c_int64(-1)
        lib().sf_add_gradient(self.handle, numel, dtype, device, _name_bytes(name),
                             ctypes.byref(out))
        self._remember(out.value, _Gradient(numel, dtype, device, name, None))
        return out.value

    def _remember(self, gid, grad):
        if gid != len(self._grads):  # the ABI promises ids 0, 1, ... in order
            raise error(ERR_INTERNAL, "sfsync returned gradient id %d, expected %d"
                         % (gid, len(self._grads)))
        self._grads.append(grad)

    @property
    def gradient_count(self):
        return len(self._grads)

    def build_buckets(self):
        lib().sf_build_buckets(self.handle)

    def gradient_data(self, gid):
        """sf_gradient_data: the address (int) of gradient ``gid``."""
        out = ctypes.c_void_p()
        lib().sf_gradient_data(self.handle, gid, ctypes.byref(out))
        return out.value

    def gradient_array(self, gid):
        """A numpy array over gradient ``gid``'s memory: no copy. For
        plugin-owned gradients that is the flat buffer itself. bfloat16 is
        returned as uint16 (numpy has no bfloat16). The array keeps this
        Context alive."""
        address = self.gradient_data(gid)  # validates gid, builds buckets
        g = self._grads[gid]
        if g.device != DEVICE_HOST:
            raise error(ERR_UNSUPPORTED, "gradient_array: gradient %d is not in host memory"
                         % gid)
        return array_at(address, g.numel, g.dtype, keep=self)  # the memory lives with self

    def zero_gradients(self):
        lib().sf_zero_gradients(self.handle)

    # -- the window

    def begin_accumulation(self):
        lib().sf_begin_accumulation(self.handle)

    def end_accumulation(self):
        lib().sf_end_accumulation(self.handle)

    def in_accumulation(self):
        """True inside a window (sf_in_accumulation)."""
        return lib().sf_in_accumulation(self.handle) == 1

    @contextlib.contextmanager
    def accumulate(self):
        """``with ctx.accumulate():`` brackets the micro-batches whose
        gradients are only summed locally (begin/end accumulation). The window
        is left even if the body raises, so the context stays usable."""
        self.begin_accumulation()
        try:
            yield self
        finally:
            self.end_accumulation()

    def grad_ready(self, gid):
        lib().sf_grad_ready(self.handle, gid)

    def synchronize(self):
        lib().sf_synchronize(self.handle)

    # -- set-up, broadcast and replica checks (Since 0.2)

    def set_store(self, set_fn, get_fn, prefix=None):
        """sf_set_store: rendezvous through the host's key-value store.

        ``set_fn(key: str, value: bytes)`` stores a value; ``get_fn(key: str,
        timeout_ms: int) -> bytes`` returns it once present, and raises
        TimeoutError (or returns None) if it did not appear in time. Any other
        exception is a store error (logged at WARN with the key). The
        callbacks are called from sfsync's threads (ctypes takes the GIL for
        them) and are kept alive by this Context until it is closed.
        ``prefix`` goes before every key (the same on every rank)."""
        cache = {}  # key -> value, for a second call with a larger buffer

        def c_set(user, key, value, nbytes):
            try:
                set_fn(key.decode(), ctypes.string_at(value, nbytes) if nbytes else b"")
                return STORE_OK
            except Exception as e:  # noqa: BLE001 - no exception may cross into C
                log(LOG_WARN, "the host store's set(%r) failed: %s" % (key, e), "python")
                return STORE_ERROR

        def c_get(user, key, timeout_ms, buffer, capacity, out_bytes):
            name = key.decode()
            try:
                value = cache.pop(name, None)
                if value is None:
                    value = get_fn(name, int(timeout_ms))
                if value is None:
                    return STORE_TIMEOUT
                value = bytes(value)
                out_bytes[0] = len(value)
                if len(value) <= capacity:
                    if value:
                        ctypes.memmove(buffer, value, len(value))
                else:
                    cache[name] = value
                return STORE_OK
            except TimeoutError:
                return STORE_TIMEOUT
            except Exception as e:  # noqa: BLE001
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    return STORE_TIMEOUT
                log(LOG_WARN, "the host store's get(%r) failed: %s" % (name, e), "python")
                return STORE_ERROR

        store = Store()
        lib().sf_store_init(ctypes.byref(store), ctypes.sizeof(store))
        store.set = STORE_SET_FN(c_set)
        store.get = STORE_GET_FN(c_get)
        lib().sf_set_store(self.handle, ctypes.byref(store), _name_bytes(prefix))
        self._keep.append((store, c_set, c_get))  # alive until sf_destroy

    def connect(self):
        """sf_connect: join the peers now (collective), so that rendezvous
        errors surface here rather than inside a backward pass."""
        lib().sf_connect(self.handle)

    def broadcast(self, data, root=0, nbytes=None):
        """sf_broadcast: copy a writable buffer (contiguous CPU tensor, numpy
        array, writable bytes-like, or int address with ``nbytes``) from rank
        ``root`` to every rank, in place (collective)."""
        address, size = address_and_size(data, nbytes)
        lib().sf_broadcast(self.handle, address or None, size, root)

    def digest_gradients(self):
        """sf_digest_gradients: the digest (int) of every registered host gradient."""
        out = ctypes.c_uint64()
        lib().sf_digest_gradients(self.handle, ctypes.byref(out))
        return out.value

    def check_replicas(self, value):
        """sf_check_replicas: compare a 64-bit digest across ranks (collective).
        Returns None when all agree; raises MismatchError on every rank
        otherwise, naming the ranks that differ from rank 0."""
        lib().sf_check_replicas(self.handle, int(value) & 0xFFFFFFFFFFFFFFFF)

    # -- CUDA / NCCL

    def set_cuda_stream(self, stream):
        """sf_set_cuda_stream: the host's cudaStream_t (an int address, or an
        object with ``.cuda_stream`` such as torch.cuda.Stream; None or 0 is
        the legacy default stream) on which it produces and reads this
        context's CUDA gradients."""
        address = getattr(stream, "cuda_stream", stream)
        lib().sf_set_cuda_stream(self.handle, address or None)

    def adopt_nccl_comm(self, comm):
        """sf_adopt_nccl_comm: use the host's ncclComm_t (an int address) for
        this context's CUDA gradients; the host keeps ownership and must keep
        it alive until this context is closed."""
        prefer_torch_cuda_libraries()
        lib().sf_adopt_nccl_comm(self.handle, comm)

    # -- stats

    def stats(self):
        """sf_get_stats as a dict (keys: STATS_KEYS)."""
        out = Stats()
        out.struct_size = ctypes.sizeof(out)
        lib().sf_get_stats(self.handle, ctypes.byref(out))
        return out.to_dict()

    def count_window(self):
        """sf_count_window (Since 0.5): count a window the host reduced (DDPSync)."""
        lib().sf_count_window(self.handle)

    def restore_windows(self, windows_completed):
        """sf_restore_windows (Since 0.4): continue a saved run's window count
        (its ``stats()["windows_completed"]``, the same on every rank) before
        this context's first window or synchronization (else InvalidStateError)."""
        lib().sf_restore_windows(self.handle, int(windows_completed))

    # -- weighted windows (Since 0.4)

    def add_window_weight(self, weight):
        """sf_add_window_weight: add ``weight`` (e.g. a micro-batch's token
        count, before its backward) to this rank's weight for the current
        window; reduce_op "weighted" only. Local, no communication. Raises
        InvalidArgumentError for a negative or non-finite weight,
        InvalidStateError when the window's last pass has started reducing
        (the message names the bucket and the window; nothing is added)."""
        lib().sf_add_window_weight(self.handle, float(weight))

    def add_window_sums(self, values):
        """sf_add_window_sums: add values[i] to this rank's window sum slot i
        (1..WINDOW_SUMS values; by convention 0 loss sum, 1 token count, 2 a
        found-inf flag, 3 a user metric). Same timing rules and errors as
        add_window_weight."""
        values = [float(v) for v in values]
        if not 1 <= len(values) <= WINDOW_SUMS:
            raise error(ERR_INVALID_ARGUMENT, "add_window_sums: %d values, 1..%d fit"
                        % (len(values), WINDOW_SUMS))
        array = (ctypes.c_double * len(values))(*values)
        lib().sf_add_window_sums(self.handle, array, len(values))

    def window_totals(self):
        """sf_get_window_totals: (global weight, [WINDOW_SUMS global sums]) of
        the last synchronized window (sums over every rank of what each
        added). InvalidStateError before the first weighted window completed."""
        weight = ctypes.c_double()
        sums = (ctypes.c_double * WINDOW_SUMS)()
        lib().sf_get_window_totals(self.handle, ctypes.byref(weight), sums, WINDOW_SUMS)
        return weight.value, list(sums)

    def bucket_info(self, index):
        """sf_bucket_info: {"bytes", "gradient_count", "dtype"} of bucket ``index``."""
        nbytes, count, dtype = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int32()
        lib().sf_bucket_info(self.handle, index, ctypes.byref(nbytes), ctypes.byref(count),
                            ctypes.byref(dtype))
        return {"bytes": nbytes.value, "gradient_count": count.value, "dtype": dtype.value}

    def buckets(self):
        """bucket_info of every bucket, in synchronization order (builds the
        buckets if needed: no gradient can be added afterwards)."""
        self.build_buckets()
        return [self.bucket_info(i) for i in range(self.stats()["bucket_count"])]

    def bucket_state(self, index):
        """sf_bucket_state (Since 0.5): bucket ``index``'s state now, a name of
        BUCKET_STATE_NAMES (include/sfsync.h's SF_BUCKET_* say when)."""
        out = ctypes.c_int32()
        lib().sf_bucket_state(self.handle, index, ctypes.byref(out))
        return BUCKET_STATE_NAMES[out.value]

    def bucket_states(self):
        """bucket_state of every bucket, in synchronization order ([] unbuilt)."""
        return [self.bucket_state(i) for i in range(self.stats()["bucket_count"])]

    def window_state(self):
        """sf_window_state (Since 0.5), SF_WINDOW_* as bools: "synchronizing",
        "gradients_whole" (include/sfsync.h)."""
        out = ctypes.c_int32()
        lib().sf_window_state(self.handle, ctypes.byref(out))
        return {"synchronizing": bool(out.value & WINDOW_SYNCHRONIZING),
                "gradients_whole": bool(out.value & WINDOW_GRADIENTS_WHOLE)}


def _name_bytes(name):
    return None if name is None else str(name).encode()


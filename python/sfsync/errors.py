"""sfsync's exceptions: one SfError subclass per sf_status, and
LibraryLoadError. Responsible for the classes and the status -> class table
only; raising them from a failed call is loader.py's (the errcheck)."""

from sfsync._abi import (ERR_BACKEND, ERR_INTERNAL, ERR_INVALID_ARGUMENT, ERR_INVALID_STATE,
                         ERR_MISMATCH, ERR_OUT_OF_MEMORY, ERR_TIMEOUT, ERR_UNSUPPORTED, OK)

__all__ = ["STATUS_NAMES", "SfError", "InvalidArgumentError", "InvalidStateError",
           "MismatchError", "BackendError", "SfTimeoutError", "UnsupportedError",
           "SfMemoryError", "InternalError", "LibraryLoadError", "ERROR_CLASSES"]

STATUS_NAMES = {
    OK: "SF_OK",
    ERR_INVALID_ARGUMENT: "SF_ERR_INVALID_ARGUMENT",
    ERR_INVALID_STATE: "SF_ERR_INVALID_STATE",
    ERR_MISMATCH: "SF_ERR_MISMATCH",
    ERR_BACKEND: "SF_ERR_BACKEND",
    ERR_TIMEOUT: "SF_ERR_TIMEOUT",
    ERR_UNSUPPORTED: "SF_ERR_UNSUPPORTED",
    ERR_OUT_OF_MEMORY: "SF_ERR_OUT_OF_MEMORY",
    ERR_INTERNAL: "SF_ERR_INTERNAL",
}


class SfError(Exception):
    """A non-zero sf_status.

    Attributes: ``status`` (the int), ``status_name`` ("SF_ERR_..."),
    ``status_string`` (sf_status_string: what to do next), ``message``
    (sf_last_error(): "function: the argument and value at fault") and
    ``function`` (the sf_* function that failed, when known).
    """

    status = None  # set by the subclasses; an instance always has its own

    def __init__(self, status, message, status_string=None, function=None):
        self.status = int(status)
        self.status_name = STATUS_NAMES.get(self.status, "status %d" % self.status)
        self.message = message
        self.status_string = status_string if status_string is not None else "unknown status"
        self.function = function
        super().__init__(str(self))

    def __str__(self):
        return "%s [%s: %s]" % (self.message, self.status_name, self.status_string)


class InvalidArgumentError(SfError, ValueError):
    """SF_ERR_INVALID_ARGUMENT: a NULL, out-of-range or malformed argument."""


class InvalidStateError(SfError):
    """SF_ERR_INVALID_STATE: a call at the wrong time (window misuse, late registration)."""


class MismatchError(SfError):
    """SF_ERR_MISMATCH: ranks disagree (gradient layout, replica digests)."""


class BackendError(SfError, ConnectionError):
    """SF_ERR_BACKEND: the transport failed (peer lost, connection refused)."""


class SfTimeoutError(SfError, TimeoutError):
    """SF_ERR_TIMEOUT: a collective or the rendezvous outlived timeout_ms."""


class UnsupportedError(SfError, NotImplementedError):
    """SF_ERR_UNSUPPORTED: not available in this build or on this machine."""


class SfMemoryError(SfError, MemoryError):
    """SF_ERR_OUT_OF_MEMORY: an allocation failed."""


class InternalError(SfError):
    """SF_ERR_INTERNAL: a bug in sfsync."""


ERROR_CLASSES = {
    ERR_INVALID_ARGUMENT: InvalidArgumentError,
    ERR_INVALID_STATE: InvalidStateError,
    ERR_MISMATCH: MismatchError,
    ERR_BACKEND: BackendError,
    ERR_TIMEOUT: SfTimeoutError,
    ERR_UNSUPPORTED: UnsupportedError,
    ERR_OUT_OF_MEMORY: SfMemoryError,
    ERR_INTERNAL: InternalError,
}


class LibraryLoadError(ImportError):
    """libsfsync could not be found or loaded, or its ABI version differs."""

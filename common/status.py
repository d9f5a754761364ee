"""The one table between the service's errors and gRPC status codes, read both ways: the sidecar's interceptor turns
a domain error into its status, and the client turns a failed call's status back into the domain error's class.

A client-side error is that class and a ``grpc.RpcError`` at once (``code()``, ``details()`` and
``trailing_metadata()`` as gRPC's own), so ``except NotFound`` and ``except grpc.RpcError`` both catch it."""

from __future__ import annotations

import grpc

from kvferry.common import errors as service
from kvferry.mappings import errors as domain

STATUS: dict[type, grpc.StatusCode] = {
    service.NotFound: grpc.StatusCode.NOT_FOUND,
    domain.Incompatible: grpc.StatusCode.FAILED_PRECONDITION,
    domain.GateFailed: grpc.StatusCode.FAILED_PRECONDITION,
    domain.InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    service.TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    service.Unavailable: grpc.StatusCode.UNAVAILABLE,
    service.Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    domain.ArtifactError: grpc.StatusCode.FAILED_PRECONDITION,
    service.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    service.CallerGone: grpc.StatusCode.CANCELLED,
    service.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""Domain error -> status (the first class in an exception's MRO that is here decides)."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status the sidecar answers ``exc`` with; INTERNAL for anything unexpected."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


class ServiceError(domain.KvferryError, grpc.RpcError):
    """A call the service failed, as the client raises it: the domain class of its status (below) and the gRPC error
    it came from (``code()``, ``details()``, ``trailing_metadata()``)."""

    def __init__(self, err: grpc.RpcError):
        self._code, self._details = err.code(), err.details()
        self._trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else ()
        super().__init__(f"{self._code.name}: {self._details}")

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return self._trailing


class Cancelled(domain.KvferryError):
    """The call was cancelled before it finished."""


class DeadlineExceeded(domain.KvferryError, TimeoutError):
    """The call ran past its deadline (the caller's timeout, or the sidecar's max_stream_seconds)."""


_CLIENT_CLASSES = {
    grpc.StatusCode.NOT_FOUND: service.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: domain.Incompatible,  # incompatible, gated off, or a bad artifact
    grpc.StatusCode.INVALID_ARGUMENT: domain.InvalidInput,
    grpc.StatusCode.RESOURCE_EXHAUSTED: service.TooLarge,
    grpc.StatusCode.UNAVAILABLE: service.Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: service.Unsupported,
    grpc.StatusCode.UNAUTHENTICATED: service.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: service.PermissionDenied,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}
_RAISED = {
    code: type(cls.__name__, (cls, ServiceError), {"__module__": __name__, "__doc__": cls.__doc__})
    for code, cls in _CLIENT_CLASSES.items()
}


def error_for(err: grpc.RpcError) -> ServiceError:
    """The typed error for a failed call: an instance of the domain class of its status (ServiceError for a status
    no domain error maps to, such as INTERNAL)."""
    if isinstance(err, ServiceError):
        return err
    return _RAISED.get(err.code(), ServiceError)(err)

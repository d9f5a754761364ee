"""Every error the service speaks of, in one place: each maps to one gRPC status (kvferry.common.status, read by the
sidecar's interceptor and by the client), and the client raises the same classes. Client, sidecar and common import
them from here. The math's own input errors (invalid input, incompatible models, bad artifacts, failed gates) are
raised by kvferry.mappings, which knows no service, and re-exported here; all share the KvferryError base."""

from kvferry.mappings.errors import ArtifactError, GateFailed, Incompatible, InvalidInput, KvferryError

__all__ = [
    "ArtifactError",
    "CallerGone",
    "GateFailed",
    "Incompatible",
    "InvalidInput",
    "KvferryError",
    "NotFound",
    "Overloaded",
    "PermissionDenied",
    "TooLarge",
    "Unauthenticated",
    "Unavailable",
    "Unsupported",
]


class NotFound(KvferryError):
    """A named map, version or prefix does not exist."""


class TooLarge(KvferryError):
    """A request exceeds a configured limit (tokens, bytes, streams)."""


class Overloaded(TooLarge):
    """Too much in flight now (the stream cap); transient: retry after ``retry_after`` seconds, here or elsewhere."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(KvferryError):
    """The service cannot take the request now (draining, a dependency down); retry elsewhere or later."""


class Unsupported(KvferryError):
    """The request asks for something this build does not implement."""


class Unauthenticated(KvferryError):
    """The call carries no valid credentials (missing or unknown bearer token)."""


class PermissionDenied(KvferryError):
    """The caller is known but asks for something its identity does not allow (another tenant's namespace)."""


class CallerGone(KvferryError):
    """The caller cancelled or disconnected: nothing more can be sent (no traceback, counted as CANCELLED)."""

"""The service's errors: each maps to one gRPC status in the sidecar's interceptor (kvferry.sidecar.interceptor), and the
client raises the same classes. The math package's own errors (invalid input, incompatible models, bad artifacts,
failed gates) live in kvferry.mappings.errors; all share its KvferryError base."""

from kvferry.mappings.errors import KvferryError


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

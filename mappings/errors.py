"""Domain errors. Each maps to one gRPC status in the sidecar's interceptor; none imports gRPC."""


class KvferryError(Exception):
    """Base class; the message says what was wrong and how to fix it."""


class NotFound(KvferryError):
    """A named map, version or prefix does not exist."""


class Incompatible(KvferryError):
    """Two models, or a model and a map, cannot be combined (fingerprint, tokenizer, RoPE)."""


class InvalidInput(KvferryError):
    """Malformed tensors, shapes, dtypes, layer counts, or stream order."""


class TooLarge(KvferryError):
    """A request exceeds a configured limit (tokens, bytes, streams)."""


class Overloaded(TooLarge):
    """Too much in flight now (the stream cap); transient: retry after ``retry_after`` seconds, here or elsewhere."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class ArtifactError(KvferryError):
    """A map artifact is corrupt, tampered with, or of an unknown format."""


class GateFailed(KvferryError):
    """A map's measured evidence is missing or below the serving gates."""


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

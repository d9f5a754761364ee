"""Domain errors. Each maps to one gRPC status in the sidecar's interceptor; none imports gRPC."""


class KvferryError(Exception):
    """Base class; the message says what was wrong and how to fix it."""


class Incompatible(KvferryError):
    """Two models, or a model and a map, cannot be combined (fingerprint, tokenizer, RoPE)."""


class InvalidInput(KvferryError):
    """Malformed tensors, shapes, dtypes, layer counts, or stream order."""


class ArtifactError(KvferryError):
    """A map artifact is corrupt, tampered with, or of an unknown format."""


class GateFailed(KvferryError):
    """A map's measured evidence is missing or below the serving gates."""

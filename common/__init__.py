"""What the client and the sidecar both use, below both: the wire codec, the request/response messages, the
service's errors, prefix keys and the block format, and the prefix stores. Client and sidecar never import each
other; both import this (import-linter contracts in pyproject.toml)."""

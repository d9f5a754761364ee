"""Who is calling: a bearer token (compared in constant time) or the mutual-TLS client certificate.

The caller's identity picks its prefix-store tenant; a request may not name another tenant. The
interceptor authenticates each kvferry call once and leaves the caller in a context variable that
the servicer reads through ``tenant_for``. Health checks stay open (kubelet probes carry no token).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
from dataclasses import dataclass

from kvferry.common.errors import InvalidInput, PermissionDenied, Unauthenticated
from kvferry.common.files import PEM_LIMIT, read_secret_text
from kvferry.common.prefix import check_tenant

PROTECTED_PREFIX = "/kvferry."  # every kvferry service; health and reflection stay open


@dataclass(frozen=True)
class Caller:
    tenant: str
    """The tenant namespace this caller's prefix blocks live in ("" when unauthenticated and unnamed)."""
    via: str
    """How it was established: "token", "mtls" or "none"."""


ANONYMOUS = Caller("", "none")
"""The caller of a server without auth: no tenant, unnamed."""

CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("kvferry_caller", default=ANONYMOUS)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """Bearer tokens from a file of ``<tenant> <token>`` lines, and/or mTLS identities (certificate CN)."""

    def __init__(self, tokens: dict[str, str] | None = None, mtls_identity: bool = False):
        for tenant in (tokens or {}).values():
            check_tenant(tenant, "tenant in the auth tokens")
        self._tokens = [(_digest(tok), tenant) for tok, tenant in (tokens or {}).items()]
        self.mtls_identity = mtls_identity

    @classmethod
    def from_file(cls, path: str, mtls_identity: bool = False) -> Authenticator:
        tokens: dict[str, str] = {}
        lines = read_secret_text(path, "auth_tokens_file", PEM_LIMIT).splitlines()
        for no, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or len(parts[1]) < 16:
                raise InvalidInput(f"{path}:{no}: expected '<tenant> <token>' with a token of at least 16 characters")
            if parts[1] in tokens:
                raise InvalidInput(f"{path}:{no}: this token is already given to tenant {tokens[parts[1]]!r}")
            tokens[parts[1]] = parts[0]
        if not tokens:
            raise InvalidInput(f"{path} holds no '<tenant> <token>' lines; every call would be refused")
        return cls(tokens, mtls_identity)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens) or self.mtls_identity

    def identify(self, metadata, auth_context: dict) -> Caller:
        """Raises Unauthenticated when credentials are required and missing or wrong."""
        if self._tokens:
            header = next((v for k, v in metadata or () if k == "authorization"), None)
            if header is None:
                raise Unauthenticated("this sidecar requires 'authorization: Bearer <token>' call metadata")
            scheme, _, token = str(header).partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise Unauthenticated("the authorization metadata must read 'Bearer <token>'")
            presented, found = _digest(token.strip()), None
            for digest, tenant in self._tokens:  # no early exit: the time does not depend on which token matched
                if hmac.compare_digest(digest, presented):
                    found = tenant
            if found is None:
                raise Unauthenticated("unknown bearer token")
            return Caller(found, "token")
        if self.mtls_identity:
            names = auth_context.get("x509_common_name") or []
            if not names:
                raise Unauthenticated(
                    "this sidecar takes the tenant from the client certificate's common name; connect with mutual TLS"
                )
            cn = names[0].decode() if isinstance(names[0], bytes) else str(names[0])
            try:
                return Caller(check_tenant(cn, "client certificate CN"), "mtls")
            except InvalidInput as e:
                raise PermissionDenied(str(e)) from None
        return ANONYMOUS


def tenant_for(requested: str) -> str:
    """The tenant a request runs under: the caller's, when authenticated; a different one is refused. Every request's
    tenant passes here, so one check covers all of them: a name that is not a valid tenant is refused whether or not
    the request would ever reach the prefix store."""
    if requested:
        check_tenant(requested, "header.tenant")
    caller = CALLER.get()
    if caller.via == "none":
        return requested
    if requested and requested != caller.tenant:
        raise PermissionDenied(
            f"this call is authenticated as tenant {caller.tenant!r} and cannot use tenant {requested!r}"
        )
    return caller.tenant

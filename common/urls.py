"""URLs in messages and logs, with every credential taken out."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_PARAMETERS = ("password", "username", "user", "pass", "secret", "token", "key", "auth", "credential")
"""Query parameters whose value is left out (a name containing any of these, in any case)."""


def redact_url(url: str) -> str:
    """``url`` without its userinfo (``user:password@``, however many ``@`` the password holds) and without the value
    of any query parameter that may carry a credential (redis-py reads ``?password=`` and ``?username=``). Parsed,
    not searched: what the URL parser would treat as a credential is what is removed. A URL that does not parse is
    not shown at all."""
    try:
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
        query = [(k, "***" if any(s in k.lower() for s in SECRET_PARAMETERS) else v)
                 for k, v in parse_qsl(parts.query, keep_blank_values=True)]
        userinfo = "***@" if "@" in parts.netloc else ""
        out = urlunsplit((parts.scheme, userinfo + host, parts.path, urlencode(query, safe="*"), ""))
        if not parts.netloc and url.startswith(f"{parts.scheme}://"):  # unix:///path keeps its empty authority
            out = f"{parts.scheme}://{out[len(parts.scheme) + 1:]}"
        return out
    except ValueError:
        return "<unparseable URL>"

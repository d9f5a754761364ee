"""Store URLs: checked once by one parser, shown in logs only with every credential taken out, never to callers."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_PARAMETERS = ("password", "username", "user", "pass", "secret", "token", "key", "auth", "credential")
"""Query parameters whose value is left out (a name containing any of these, in any case)."""


def check_store_url(url: str) -> None:
    """Refuse a store URL that the URL parser would read otherwise than it looks: a ``#`` (it ends the URL, so a
    password holding one is cut there), a path that is not a database number (``redis://h:6379/pw@x``: the ``@``
    after the host is no userinfo), a port that is not a number, a query parameter without a value. The message
    describes what is wrong and echoes none of the URL (it may hold a password)."""

    def refuse(why: str) -> None:
        raise ValueError(
            f"the prefix store URL {why}; percent-encode such characters in a password (or give it in "
            "redis_password_file) and check the URL's shape: redis://[user@]host:port/db"
        )

    if "#" in url:
        refuse("holds a '#', which ends a URL")
    try:
        parts = urlsplit(url)
        if parts.scheme.endswith("+cluster"):  # seeds: host:port, comma-separated
            for seed in parts.netloc.rpartition("@")[2].split(","):
                _ = urlsplit(f"redis://{seed.strip()}").port  # a port that is not a number raises here
        else:
            _ = parts.port
    except ValueError:
        refuse("cannot be parsed")
    if parts.scheme != "unix":
        path = parts.path.strip("/")
        if path and not path.isdigit():
            refuse("has a path that is not a database number")
        if not parts.netloc.rpartition("@")[2]:
            refuse("names no host")
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if not value or not name:
            refuse("has a query parameter without a name or a value")


def redact_url(url: str) -> str:
    """``url`` without its userinfo (``user:password@``, however many ``@`` the password holds) and without the value
    of any query parameter that may carry a credential (redis-py reads ``?password=`` and ``?username=``). Parsed,
    not searched: what the URL parser would treat as a credential is what is removed (names percent-decoded, as
    redis-py reads them). A URL that does not parse, or that :func:`check_store_url` refuses, is not shown at all."""
    try:
        if url.startswith(("redis", "unix")):
            check_store_url(url)
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
        query = [
            (k, "***" if any(s in k.lower() for s in SECRET_PARAMETERS) else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ]
        userinfo = "***@" if "@" in parts.netloc else ""
        out = urlunsplit((parts.scheme, userinfo + host, parts.path, urlencode(query, safe="*"), ""))
        if not parts.netloc and url.startswith(f"{parts.scheme}://"):  # unix:///path keeps its empty authority
            out = f"{parts.scheme}://{out[len(parts.scheme) + 1 :]}"
        return out
    except ValueError:
        return "<unparseable URL>"

"""Prefix stores: Redis (shared across pods) and an in-process LRU bounded in bytes (the default).

Both offer the same calls. Writes use "set if absent" with a TTL: a value appears whole or not
at all, and concurrent writers of one block (whose content is identical by construction) cannot
corrupt it. Connection failures raise :class:`StoreUnavailable`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from kvferry.common.errors import Unavailable
from kvferry.common.urls import check_store_url, redact_url


class StoreUnavailable(Unavailable):
    """The prefix store cannot be reached (down, timing out, refusing). Its message, which callers see, names "the
    prefix store" and never its address; ``detail`` (for the operator's log) adds the store's redacted URL and the
    client library's own words."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail or message


class StoreUnreachable(StoreUnavailable):
    """The prefix store did not answer: down, or slower than its timeout (what opens a GuardedStore's circuit; a store
    that answers with a refusal, full or denying, stays called)."""


class StoreSkipped(StoreUnavailable):
    """The prefix store was not called: its circuit is open after a failure (GuardedStore)."""


class MemoryStore:
    """An LRU of blobs bounded by total bytes, with per-entry expiry; thread-safe."""

    def __init__(self, max_bytes: int = 512 << 20):
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        now = time.monotonic()
        out = []
        with self._lock:
            for k in keys:
                item = self._data.get(k)
                if item is None or item[1] < now:
                    if item is not None:
                        self._drop(k)
                    out.append(None)
                    continue
                self._data.move_to_end(k)
                out.append(item[0])
        return out

    def exists_many(self, keys: list[str]) -> list[bool]:
        now = time.monotonic()
        with self._lock:
            return [k in self._data and self._data[k][1] >= now for k in keys]

    def put_many(self, items: list[tuple[str, bytes]], ttl: float) -> int:
        written = 0
        with self._lock:
            for k, blob in items:
                if k in self._data or len(blob) > self.max_bytes:
                    continue
                self._data[k] = (blob, time.monotonic() + ttl)
                self._bytes += len(blob)
                written += 1
                while self._bytes > self.max_bytes:
                    self._drop(next(iter(self._data)))
        return written

    def discard(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                if k in self._data:
                    self._drop(k)

    def _drop(self, key: str) -> None:
        blob, _ = self._data.pop(key)
        self._bytes -= len(blob)

    @property
    def nbytes(self) -> int:
        return self._bytes


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
"""A Redis Cluster (or Valkey cluster): ``redis+cluster://[user:password@]host:port[,host:port...][/?options]``, with
``rediss+cluster://`` for TLS. Any reachable nodes will do as seeds; the client learns the slot map from them."""


STORE_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)
"""What a prefix store's URL may start with (the one answer to "is this a store URL")."""


class RedisStore:
    """redis:// or rediss:// (TLS), with optional ACL user and password; pooled; hiredis when installed. A cluster URL
    (CLUSTER_SCHEMES) uses redis-py's cluster client: keys are spread over every master by their slot (no hash tags:
    a tenant's blocks are spread too), and a lookup of many blocks is one pipelined MGET per slot, sent to each master
    at once, not one cross-slot MGET (which a cluster refuses) nor a round trip per block."""

    def __init__(
        self,
        url: str,
        password: str | None = None,
        username: str | None = None,
        timeout: float = 2.0,
        max_connections: int = 32,
    ):
        import redis

        if not url.startswith(STORE_SCHEMES):
            raise ValueError(
                "the prefix store URL must start with redis://, rediss://, unix:// or redis+cluster:// "
                "(rediss+cluster://)"
            )
        check_store_url(url)
        kw = dict(socket_timeout=timeout, socket_connect_timeout=timeout, max_connections=max_connections)
        if password:
            kw["password"] = password
        if username:
            kw["username"] = username
        self.url = url
        self.cluster = url.startswith(CLUSTER_SCHEMES)
        self._errors = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
        if self.cluster:
            self._seeds, self._cluster_kw = _cluster_seeds(url, kw)
            self._client = None
            self._lock = threading.Lock()
            return
        self._redis = redis.Redis.from_url(url, health_check_interval=15, retry_on_timeout=False, **kw)
        try:  # redis-py reads unknown URL parameters as connection arguments, refused only at the first call
            self._redis.connection_pool.connection_class(**self._redis.connection_pool.connection_kwargs)
        except TypeError as e:
            raise ValueError(
                f"redis URL {redact_url(url)!r} has a parameter redis-py does not accept "
                f"({str(e).rpartition(' ')[2]}); see redis-py's from_url for the ones it reads"
            ) from None

    @property
    def _r(self):
        """The client: for a cluster, made on first use (it reads the slot map from a seed), and made again after a
        failure to reach any seed, so a sidecar that starts while the cluster is down serves once it is up."""
        if not self.cluster:
            return self._redis
        with self._lock:
            if self._client is None:
                from redis.cluster import RedisCluster

                try:
                    self._client = RedisCluster(startup_nodes=self._seeds, **self._cluster_kw)
                except self._errors as e:
                    raise self._failed(e) from None
            return self._client

    def _failed(self, e: Exception) -> StoreUnavailable:
        """The store's failure in words that carry no key and no blob bytes: redis-py's pipeline errors quote the
        whole failing command ("Command # 1 (SET <key> <blob> …) of pipeline caused error: OOM …")."""
        import redis

        detail = f"prefix store {self._safe_url()}: {type(e).__name__}: {str(e)[:160]}"
        if isinstance(e, (redis.ConnectionError, redis.TimeoutError, OSError)):  # their words name the host and port
            return StoreUnreachable(f"the prefix store is unreachable ({type(e).__name__})", detail)
        reason = str(e).split("caused error:", 1)[-1].strip().splitlines()[0][:160] if str(e) else ""
        return StoreUnavailable(f"the prefix store refused the call ({type(e).__name__}: {reason})", detail)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            r = self._r
            return list(r.mget_nonatomic(keys) if self.cluster else r.mget(keys))
        except self._errors as e:
            raise self._failed(e) from None

    def exists_many(self, keys: list[str]) -> list[bool]:
        """Which keys are stored, without fetching them (a cheap probe for schedulers)."""
        if not keys:
            return []
        try:
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(r) for r in pipe.execute()]
        except self._errors as e:
            raise self._failed(e) from None

    def put_many(self, items: list[tuple[str, bytes]], ttl: float) -> int:
        if not items:
            return 0
        try:
            pipe = self._r.pipeline(transaction=False)
            for k, blob in items:
                pipe.set(k, blob, nx=True, px=max(1, int(ttl * 1000)))
            return sum(bool(r) for r in pipe.execute())
        except self._errors as e:
            raise self._failed(e) from None

    def discard(self, keys: list[str]) -> None:
        """Delete blobs found corrupt, so the next writer can store a good copy (writes never overwrite)."""
        if not keys:
            return
        try:
            pipe = self._r.pipeline(transaction=False)
            for k in keys:  # one DEL a key: a cluster refuses one across slots
                pipe.delete(k)
            pipe.execute()
        except self._errors as e:
            raise self._failed(e) from None

    def ping(self) -> bool:
        try:
            return bool(self._r.ping())
        except (*self._errors, StoreUnavailable):
            return False

    def _safe_url(self) -> str:
        return redact_url(self.url)  # never log credentials


def _cluster_seeds(url: str, kw: dict):
    """The seed nodes and client arguments of a cluster URL (credentials in it are used, never shown)."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    from redis.cluster import ClusterNode

    parts = urlsplit(url.replace("+cluster://", "://", 1))
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for hp in hosts.split(","):
        host, _, port = hp.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis cluster URL {redact_url(url)!r}: seeds must be host:port, comma-separated")
        seeds.append(ClusterNode(host.strip("[]"), int(port)))
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    out = dict(kw, ssl=parts.scheme == "rediss", retry=Retry(NoBackoff(), 1))  # fail fast: the caller falls back
    if userinfo:
        user, _, pw = userinfo.partition(":")
        out.setdefault("username", unquote(user) or None)
        out.setdefault("password", unquote(pw) or None)
    for k, v in parse_qsl(parts.query):
        if k in ("password", "username"):
            out[k] = v
        else:
            raise ValueError(
                f"redis cluster URL {redact_url(url)!r}: parameter {k!r} is not read for a cluster "
                "(only username and password; set timeouts in the sidecar's settings)"
            )
    return seeds, {k: v for k, v in out.items() if v is not None}


class GuardedStore:
    """A store behind a circuit breaker: once a call gets no answer (down, or slower than the store's timeout), the
    store is not called for ``cooldown`` seconds: every call in that time raises StoreUnavailable at once, so a hung
    store costs one timeout per cooldown, not one per request. The first call after the cooldown tries the store
    again; ``on_change(open)`` hears each opening and closing (metrics, health)."""

    def __init__(self, store, cooldown: float, on_change=None, clock=time.monotonic):
        self.store, self.cooldown, self.on_change, self.clock = store, cooldown, on_change, clock
        self._until = 0.0  # the store is skipped until this time
        self._open = False
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        """Whether calls skip the store now."""
        return self.clock() < self._until

    def _call(self, fn, *args):
        if self.open:
            raise StoreSkipped("the prefix store is skipped for a while after failing (its circuit is open)")
        try:
            out = fn(*args)
        except StoreUnreachable:
            self._set(True)
            raise
        except StoreUnavailable:  # it answered, with a refusal: reachable
            self._set(False)
            raise
        self._set(False)
        return out

    def _set(self, failed: bool) -> None:
        with self._lock:
            if failed:
                self._until = self.clock() + self.cooldown
            changed, self._open = self._open != failed, failed
        if changed and self.on_change is not None:
            self.on_change(failed)

    def get_many(self, keys):
        return self._call(self.store.get_many, keys)

    def exists_many(self, keys):
        return self._call(self.store.exists_many, keys)

    def put_many(self, items, ttl):
        return self._call(self.store.put_many, items, ttl)

    def discard(self, keys):
        return self._call(self.store.discard, keys)

    def ping(self) -> bool:
        return not self.open and self.store.ping()


def open_store(
    url: str = "",
    password: str | None = None,
    memory_bytes: int = 512 << 20,
    timeout: float = 2.0,
    cooldown: float = 0.0,
    on_change=None,
):
    """RedisStore for a URL (behind a circuit breaker of ``cooldown`` seconds when positive), else the in-process
    MemoryStore (which cannot fail)."""
    if not url:
        return MemoryStore(memory_bytes)
    store = RedisStore(url, password, timeout=timeout)
    return GuardedStore(store, cooldown, on_change) if cooldown > 0 else store

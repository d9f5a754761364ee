"""Shared prefixes on a real Redis Cluster: three masters started here (redis-server --cluster-enabled yes, then
redis-cli --cluster create), a real sidecar and the direct reader on them."""

import shutil

import grpc
import pytest
import torch
from conftest import make_kv, spec_kw, wait_until

from kvferry.bench.harness import RedisClusterServers
from kvferry.client.client import ClientOptions, Retry, TranslateClient
from kvferry.client.direct import DirectReader
from kvferry.common.prefix_cache import publish_source
from kvferry.common.stores import MemoryStore, RedisStore, StoreUnavailable

SECRET, BS = b"cluster-secret", 16
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisClusterServers(str(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


@pytest.fixture
def fresh(cluster):
    """The cluster with every master up and every key gone."""
    for i, proc in enumerate(cluster.procs):
        if proc.poll() is not None:
            cluster.restart(i)
    cluster.wait_ok()
    for port in cluster.ports:
        cluster.node(port).flushall()
    return cluster


@pytest.fixture(scope="module")
def maps_dir(self_maps):
    return self_maps


def _kw(family):
    return spec_kw(family["S"])


def _published(family, url, tokens=64, seed=1, first=100, tenant="acme"):
    kv = make_kv(layers=4, tokens=tokens, heads=2, head_dim=32, seed=seed)
    ids = list(range(first, first + tokens))
    key = publish_source(
        kv, ids, family["S"].identity, store=RedisStore(url), secret=SECRET, tenant=tenant, block_size=BS
    )
    return kv, ids, key


def _keys(cluster) -> set[bytes]:
    return {k for p in cluster.ports for k in cluster.node(p).keys("kvf:*")}


def test_hits_and_misses_on_a_cluster(sidecar_factory, maps_dir, family, fresh):
    """The same answers as on one node: a key-only miss maps the stored source and writes it back, spread over every
    master; the next ask is a full hit, through the sidecar and read directly; another tenant sees nothing."""
    sc = sidecar_factory(
        maps_dir=str(maps_dir),
        force_maps=True,
        redis_url=fresh.url,
        prefix_secret=SECRET.decode(),
        prefix_block_size=BS,
    )
    kv, ids, key = _published(family, fresh.url)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:

        def ask(**kw):
            return c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family), **kw)

        miss = ask()
        assert miss.stats.cached_blocks == 0 and miss.info.num_tokens == 64
        wait_until(lambda: len(_keys(fresh)) == 8, 10, "the mapped blocks written back")
        hit = ask()
        assert hit.stats.cached_blocks == 4
        for (k, v), (hk, hv), (sk, _sv) in zip(miss.layers(), hit.layers(), kv):
            assert torch.equal(k, hk) and torch.equal(v, hv)
            torch.testing.assert_close(hk, sk, rtol=1e-5, atol=1e-5)
        with pytest.raises(grpc.RpcError) as e:
            c.translate(None, "S__S-self", token_ids=ids, tenant="globex", prefix_key=key, **_kw(family))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    per_master = [fresh.node(p).dbsize() for p in fresh.ports]
    assert sum(per_master) == 8 and sum(n > 0 for n in per_master) >= 2  # no hash tags: spread over the masters
    direct = DirectReader(RedisStore(fresh.url), SECRET, BS)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0)), direct=direct) as c:
        res = c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family))
    assert res.attempts == 0 and res.stats.extra["path"] == "direct"
    for (k, _), (hk, _) in zip(hit.layers(), res.layers()):
        assert torch.equal(k, hk)


def test_keys_are_those_of_one_node(family, fresh):
    """The HMAC key chain does not depend on where blocks live: a cluster holds exactly the keys one node would."""
    kv = make_kv(layers=4, tokens=48, heads=2, head_dim=32, seed=3)
    ids = list(range(48))
    one = MemoryStore()
    a = publish_source(kv, ids, family["S"].identity, store=one, secret=SECRET, tenant="acme", block_size=BS)
    b = publish_source(
        kv, ids, family["S"].identity, store=RedisStore(fresh.url), secret=SECRET, tenant="acme", block_size=BS
    )
    assert a == b and {k.decode() for k in _keys(fresh)} == set(one._data)


def test_a_master_killed_mid_load(sidecar_factory, maps_dir, family, fresh):
    """With one master down, key-only requests whose blocks live there get UNAVAILABLE (nothing wrong is served),
    streamed requests are still served, and once the master is back (empty: a cache without persistence) the prefix is
    published again and served."""
    sc = sidecar_factory(
        maps_dir=str(maps_dir),
        force_maps=True,
        redis_url=fresh.url,
        prefix_secret=SECRET.decode(),
        prefix_block_size=BS,
    )
    kv, ids, key = _published(family, fresh.url, tokens=128, seed=5, first=300)  # 8 blocks: on every master
    fresh.kill(1)
    with TranslateClient(ClientOptions(target=sc.address, timeout=30, retry=Retry(retries=0))) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        streamed = c.translate(kv, "S__S-self", token_ids=ids, tenant="acme", **_kw(family))
        torch.testing.assert_close(streamed.layers()[3][1], kv[3][1])
        fresh.restart(1)
        fresh.wait_ok()
        wait_until(lambda: _served(c, kv, ids, key, family, fresh.url), 30, "key-only requests served again")


def _served(c, kv, ids, key, family, url) -> bool:
    try:
        publish_source(
            kv, ids, family["S"].identity, store=RedisStore(url), secret=SECRET, tenant="acme", block_size=BS
        )
        res = c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family))
    except (grpc.RpcError, StoreUnavailable) as e:
        assert not isinstance(e, grpc.RpcError) or e.code() == grpc.StatusCode.UNAVAILABLE, (
            e
        )  # reconnecting: never wrong
        return False
    torch.testing.assert_close(res.layers()[2][0], kv[2][0], rtol=1e-5, atol=1e-5)
    return True


def test_moved_and_ask_during_a_slot_migration(family, fresh):
    """A slot holding published blocks is migrated to another master key by key: reads during the migration (ASK)
    and after it (MOVED) return the same blocks."""
    _kv, _ids, _key = _published(family, fresh.url, tokens=96, seed=7, first=700)
    store = RedisStore(fresh.url)
    keys = sorted(k.decode() for k in _keys(fresh))
    want = store.get_many(keys)
    admin = fresh.client()
    slot = admin.keyslot(keys[0])
    src = admin.get_node_from_key(keys[0])
    dst = next(n for n in admin.get_primaries() if n.port != src.port)
    src_id, dst_id = (fresh.node(n.port).execute_command("CLUSTER", "MYID").decode() for n in (src, dst))
    s, d = fresh.node(src.port), fresh.node(dst.port)
    d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    moved = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
    assert moved
    for k in moved:  # the slot's keys now on the new master while the slot still belongs to the old: ASK redirects
        s.execute_command("MIGRATE", "127.0.0.1", dst.port, k, 0, 5000)
    import redis

    with pytest.raises(redis.exceptions.AskError):  # what a client that does not follow redirects would get
        s.get(keys[0])
    assert store.get_many(keys) == want
    for node in (d, s):
        node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    fresh.wait_ok()
    assert store.get_many(keys) == want  # MOVED: the client follows the slot to its new master
    assert store.exists_many(keys) == [True] * len(keys)


def test_acl_users_confine_each_tenant(family, fresh):
    """A tenant's ACL user (created on every master) reads its own keys and is refused another tenant's: the store
    says so as StoreUnavailable, never data."""
    _published(family, fresh.url, tokens=32, seed=9, first=900, tenant="acme")
    _published(family, fresh.url, tokens=32, seed=9, first=900, tenant="globex")
    for port in fresh.ports:
        fresh.node(port).execute_command("ACL", "SETUSER", "acme", "on", ">acme-pw", "~kvf:acme:*", "+@all")
    acme = RedisStore(fresh.url, password="acme-pw", username="acme")
    mine = sorted(k.decode() for k in _keys(fresh) if k.startswith(b"kvf:acme:"))
    theirs = sorted(k.decode() for k in _keys(fresh) if k.startswith(b"kvf:globex:"))
    assert all(acme.get_many(mine))
    with pytest.raises(StoreUnavailable, match="refused"):
        acme.get_many(theirs)

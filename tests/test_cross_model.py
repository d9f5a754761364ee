"""Real cross-model maps through the sidecar: S -> T (6 layers, 3 kv heads) and S -> T64 (head_dim 64), where a
source/target mix-up cannot pass as it can with an identity map. Every path (contiguous, paged, key-only from the
prefix store, and the client's direct read) must equal the in-process apply() of the same map."""

import shutil

import pytest
import torch
from conftest import ROOT, make_kv

from kvferry.client.client import ClientOptions, Retry, TranslateClient
from kvferry.client.direct import DirectReader
from kvferry.client.importers import PagedKVPool
from kvferry.common.prefix_cache import publish_source
from kvferry.common.stores import RedisStore
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load
from kvferry.mappings.lab.capture import capture_kv

PAIRS = ["S__T", "S__T64"]
SECRET, BS = b"cross-model-secret", 16


@pytest.fixture(scope="module")
def maps_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross-maps")
    for pair in PAIRS:
        shutil.copytree(ROOT / "maps" / pair / "1.0.0", root / pair / "1.0.0")
    return root


@pytest.fixture(scope="module")
def source(family):
    s = family["S"]
    ids = list(range(11, 11 + 50))
    return s, ids, capture_kv(s.model, torch.tensor([ids]))


def _expected(maps_dir, pair, kv, tokens=None):
    ms = load(maps_dir / pair / "1.0.0")
    want = apply(ms, kv, 0)
    return ms, [(k[:, :, :tokens], v[:, :, :tokens]) for k, v in want] if tokens else want


def _same(got, want, tol=1e-4):  # chunked matmuls round differently from one big one
    assert len(got) == len(want)
    for (k, v), (wk, wv) in zip(got, want):
        assert k.shape == wk.shape, (k.shape, wk.shape)
        torch.testing.assert_close(k.float(), wk.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(v.float(), wv.float(), rtol=tol, atol=tol)


def _kw(s):
    return dict(source_geometry=s.identity.geometry.fingerprint, tokenizer=s.identity.tokenizer)


@pytest.mark.parametrize("pair", PAIRS)
def test_streamed_contiguous_and_paged_equal_apply(sidecar_factory, maps_dir, source, pair):
    s, ids, kv = source
    ms, want = _expected(maps_dir, pair, kv)
    tg = ms.target.geometry
    assert (tg.layers, tg.kv_heads, tg.head_dim) != (4, 2, 32)  # not the source's shape: a mix-up would show
    sc = sidecar_factory(maps_dir=str(maps_dir))
    with TranslateClient(ClientOptions(target=sc.address, chunk_tokens=16, retry=Retry(retries=0))) as c:
        res = c.translate(kv, pair, "1.0.0", **_kw(s))
        assert (res.info.layers, res.info.kv_heads, res.info.head_dim) == (tg.layers, tg.kv_heads, tg.head_dim)
        _same(res.layers(), want)
        paged = c.translate(kv, pair, "1.0.0", layout="paged", block_size=8, **_kw(s))
    i = paged.info
    pool = PagedKVPool(i.layers, 8, 8, i.kv_heads, i.head_dim, dtype=i.dtype)
    table = pool.allocate(len(ids))
    pool.write(paged.blocks, table)
    _same(pool.gather(table, len(ids)), want)
    pool.free(table)  # the table's blocks go back to the pool for the next request
    assert sorted(pool.allocate(len(ids))) == sorted(table)


@pytest.mark.parametrize("order", ["tokens", "layers"])
def test_chunks_in_token_or_layer_order_equal_apply(sidecar_factory, maps_dir, source, order):
    """Source chunks in token order (each range for every layer) or layer order (consecutive chunks of one layer)
    translate alike through a real cross-model map, and a chunk sent twice is refused."""
    import grpc

    from kvferry.client.client import TRANSLATE_METHOD, encode_requests, make_spec
    from kvferry.client.importers import contiguous_layers
    from kvferry.common import wire
    from kvferry.common.messages import Block

    s, ids, kv = source
    ms, want = _expected(maps_dir, "S__T", kv)
    sc = sidecar_factory(maps_dir=str(maps_dir))
    reqs = list(
        encode_requests(make_spec(kv, "S__T", "1.0.0", **_kw(s)), kv, chunk_tokens=8, order=order, encoded=True)
    )
    with grpc.insecure_channel(sc.address) as ch:
        call = ch.stream_stream(
            TRANSLATE_METHOD, request_serializer=wire.serialize, response_deserializer=wire.decode_response
        )
        blocks = [m for m in call(iter(reqs), timeout=30) if isinstance(m, Block)]
        _same(contiguous_layers(blocks, ms.target.geometry.layers, len(ids)), want)
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter(reqs[:3] + reqs[2:]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of order" in err.value.details()


@pytest.mark.parametrize("pair", PAIRS)
def test_key_only_and_direct_reads_equal_apply(sidecar_factory, maps_dir, source, redis_url, pair):
    s, ids, kv = source
    covered = len(ids) // BS * BS  # full prefix blocks only
    _, want = _expected(maps_dir, pair, kv, covered)
    key = publish_source(kv, ids, s.identity, store=RedisStore(redis_url), secret=SECRET, tenant="acme", block_size=BS)
    sc = sidecar_factory(
        maps_dir=str(maps_dir), redis_url=redis_url, prefix_secret=SECRET.decode(), prefix_block_size=BS
    )
    direct = DirectReader(RedisStore(redis_url), SECRET, BS)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0)), direct=direct) as c:

        def ask():
            return c.translate(None, pair, "1.0.0", token_ids=ids, tenant="acme", prefix_key=key, **_kw(s))

        mapped = ask()  # the sidecar maps the stored source blocks and writes the target blocks back
        assert mapped.attempts == 1 and mapped.info.num_tokens == covered
        _same(mapped.layers(), want)
        hit = ask()  # now read straight from Redis by the client
        assert hit.attempts == 0 and hit.stats.extra["path"] == "direct"
        _same(hit.layers(), want)


@pytest.mark.parametrize("pair", PAIRS)
def test_a_sidecar_hit_sends_the_stored_bytes_cut_to_the_message_limit(
    sidecar_factory, maps_dir, source, redis_url, pair
):
    """A hit through the sidecar sends the stored blobs' bytes as they are (no tensors): at the smallest message limit,
    its blocks cut the 16-token stored blocks mid-way, and still carry exactly what the miss mapped and stored."""
    s = source[0]
    g = s.identity.geometry
    n = 2600
    kv = [
        (k * 0.1, v * 0.1) for k, v in make_kv(layers=g.layers, tokens=n, heads=g.kv_heads, head_dim=g.head_dim, seed=3)
    ]
    ids = [(7 * i) % 500 + 1 for i in range(n)]
    key = publish_source(kv, ids, s.identity, store=RedisStore(redis_url), secret=SECRET, tenant="acme", block_size=BS)
    sc = sidecar_factory(
        maps_dir=str(maps_dir),
        redis_url=redis_url,
        prefix_secret=SECRET.decode(),
        prefix_block_size=BS,
        max_message_bytes=1 << 20,
    )
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:

        def ask():
            return c.translate(None, pair, "1.0.0", token_ids=ids, tenant="acme", prefix_key=key, **_kw(s))

        mapped = ask()  # maps the stored source blocks, sends tensors, writes the target blocks back
        hit = ask()
    assert hit.stats.cached_blocks == n // BS and hit.stats.compute_seconds == 0
    cuts = [b.end for b in hit.blocks if b.layer == 1]
    assert len(cuts) > 1 and cuts[0] % BS != 0 and cuts[-1] == n // BS * BS, cuts  # mid-block cuts
    for (k, v), (mk, mv) in zip(hit.layers(), mapped.layers()):
        assert torch.equal(k, mk) and torch.equal(v, mv)

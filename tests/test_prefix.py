"""The prefix store: identity, block format, stores, and the sidecar's reuse flows (real redis-server)."""

import json
import re
import threading
from pathlib import Path

import grpc
import pytest
import torch
from conftest import ROOT, make_kv, sample, wait_until

from kvferry.client.client import ClientOptions, Retry, TranslateClient
from kvferry.common.prefix import CorruptBlock, Namespace, block_hashes, decode_block, encode_block, map_namespaces
from kvferry.common.prefix_cache import PrefixCache, publish_source
from kvferry.common.stores import MemoryStore, RedisStore, StoreUnavailable
from kvferry.mappings.artifact import save
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.lab.fit import identity_mapset

SECRET = b"test-secret"
BS = 16


def test_chained_hashes_share_prefixes_and_isolate_tenants():
    ns = Namespace("a", "model")
    ids = list(range(100))
    short, long = block_hashes(SECRET, ns, ids[:40], BS), block_hashes(SECRET, ns, ids, BS)
    assert len(short) == 2 and len(long) == 6 and long[:2] == short
    assert block_hashes(SECRET, ns, [1, *ids[1:]], BS)[0] != long[0]  # any token changes the chain
    assert block_hashes(SECRET, Namespace("b", "model"), ids, BS)[0] != long[0]  # tenants never share keys
    assert block_hashes(SECRET, Namespace("a", "model", "map@1"), ids, BS)[0] != long[0]  # nor do map versions
    assert block_hashes(b"other", ns, ids, BS)[0] != long[0]  # the key depends on the deployment secret
    assert re.fullmatch(r"kvf:a:[0-9a-f]{64}", ns.key(long[0])) and ns.key(long[0]).endswith(long[0].hex())
    with pytest.raises(InvalidInput, match="tenant"):
        Namespace("a/b", "m")


def test_block_roundtrip_and_corruption():
    layers = [(k[0, :, :BS], v[0, :, :BS]) for k, v in make_kv(layers=3, tokens=BS, heads=2, head_dim=8)]
    h = b"\x01" * 32
    blob = encode_block(layers, h, BS)
    back = decode_block(blob, h, 3, (2, BS, 8))
    torch.testing.assert_close(back[2][1], layers[2][1])
    bad = bytearray(blob)
    bad[-3] ^= 1
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block(bytes(bad), h, 3, (2, BS, 8))
    with pytest.raises(CorruptBlock):
        decode_block(blob[: len(blob) // 2], h, 3, (2, BS, 8))
    with pytest.raises(CorruptBlock, match="metadata"):
        decode_block(blob, b"\x02" * 32, 3, (2, BS, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_bytes_are_the_bytes_the_tensor_path_would_send(dtype):
    """A hit is sent from the stored blobs' bytes (pieces gathered head by head, block by block, one copy into the
    message): for any token range, aligned to the blocks or not, the message equals the one built from tensors."""
    from kvferry.common import wire
    from kvferry.common.messages import Block, BlockBytes

    heads, dim, n = 3, 8, 3 * BS
    kv = make_kv(layers=2, tokens=n, heads=heads, head_dim=dim, seed=5, dtype=dtype)
    ids = list(range(100, 100 + n))
    pc, ns = PrefixCache(MemoryStore(), SECRET, BS), Namespace("acme", "m")
    pc.publish(ns, ids, kv)
    look = pc.lookup(ns, ids, 2, heads, dim, dtype=dtype)
    assert look.as_stored and look.tokens == n
    joined = look.layers()
    for layer in range(2):
        torch.testing.assert_close(joined[layer][0], kv[layer][0], rtol=0, atol=0)
        for start, stop in [(0, n), (0, BS), (5, 21), (BS, 2 * BS + 1), (n - 1, n)]:
            k, v = joined[layer][0][0, :, start:stop], joined[layer][1][0, :, start:stop]
            want = wire.encode_block_response(Block(layer, start, stop, 7, k, v))
            got = wire.encode_block_response(
                BlockBytes(
                    layer,
                    start,
                    stop,
                    7,
                    dtype,
                    (heads, stop - start, dim),
                    look.pieces(layer, 0, start, stop),
                    look.pieces(layer, 1, start, stop),
                )
            )
            assert got == want, (layer, start, stop)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    converted = pc.lookup(ns, ids, 2, heads, dim, dtype=other)
    assert not converted.as_stored  # another dtype goes through tensors
    torch.testing.assert_close(converted.layers()[1][1], kv[1][1].to(other), rtol=0, atol=0)
    # Blocks stored in different dtypes (writers that asked for different ones) are converted block by block.
    pc2 = PrefixCache(MemoryStore(), SECRET, BS)
    pc2.publish(ns, ids[:BS], [(k[..., :BS, :], v[..., :BS, :]) for k, v in kv])
    pc2.publish(
        ns, ids, [(k.to(other), v.to(other)) for k, v in kv]
    )  # the first block is kept (writes never overwrite)
    mixed = pc2.lookup(ns, ids, 2, heads, dim, dtype=dtype)
    assert [b.dtype for b in mixed.blocks] == [dtype, other, other] and not mixed.as_stored
    torch.testing.assert_close(mixed.layers()[0][0][..., :BS, :], kv[0][0][..., :BS, :], rtol=0, atol=0)
    torch.testing.assert_close(
        mixed.layers()[0][0][..., BS:, :], kv[0][0][..., BS:, :].to(other).to(dtype), rtol=0, atol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_join_of_blocks_laid_out_alike_or_not_gives_the_layers_back(dtype):
    """Blocks laid out alike are joined in one call (views of one array, whatever order the format lays the layers
    in: 11 layers put layer.10 before layer.2); a block laid out otherwise falls back to the piece-by-piece join,
    with the same values."""
    import dataclasses

    from kvferry.common.prefix_cache import Lookup

    heads, dim, n, layers = 2, 8, 3 * BS, 11
    kv = make_kv(layers=layers, tokens=n, heads=heads, head_dim=dim, seed=9, dtype=dtype)
    ids = list(range(7, 7 + n))
    pc, ns = PrefixCache(MemoryStore(), SECRET, BS), Namespace("acme", "m")
    pc.publish(ns, ids, kv)
    look = pc.lookup(ns, ids, layers, heads, dim)
    assert [off for pair in look.blocks[0].offsets for off in pair] != sorted(
        off for pair in look.blocks[0].offsets for off in pair
    )
    for got, want in zip(look.layers(), kv):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # The middle block's layer 0 with K and V swapped in its bytes (and its offsets saying so): another layout.
    mid = look.blocks[1]
    (k0, v0), size = mid.offsets[0], mid.nbytes
    data = bytearray(mid.data)
    data[k0 : k0 + size], data[v0 : v0 + size] = mid.data[v0 : v0 + size], mid.data[k0 : k0 + size]
    swapped = dataclasses.replace(mid, data=memoryview(bytes(data)), offsets=((v0, k0), *mid.offsets[1:]))
    other = Lookup(look.hashes, 0, [look.blocks[0], swapped, look.blocks[2]])
    for got, want in zip(other.layers(), kv):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Cast to another dtype while joining: in one pass for blocks laid out alike, block by block for the others.
    for blocks, one_pass in ((look.blocks, True), (other.blocks, False)):
        assert (Lookup(look.hashes, 0, blocks)._join_cast(torch.float16) is not None) == one_pass
        cast = Lookup(look.hashes, 0, blocks, dtype=torch.float16).layers()
        for got, want in zip(cast, kv):
            assert got[0].dtype == torch.float16 and torch.equal(got[0], want[0].to(torch.float16))
            assert torch.equal(got[1], want[1].to(torch.float16))
    # Token-major (what the paged layout sends): the same values, memory laid out [tokens, kv_heads, head_dim]
    for blocks in (look.blocks, other.blocks):
        for asked in (None, torch.float16):
            for got, want in zip(Lookup(look.hashes, 0, blocks, dtype=asked).layers(token_major=True), kv):
                for g, w in zip(got, want):
                    assert g.dtype == (asked or dtype) and torch.equal(g, w.to(asked or dtype))
                    assert g[0].transpose(0, 1).is_contiguous()


def test_a_stored_block_gives_every_layer_as_views_of_its_bytes_laid_out_alike_or_not():
    """StoredBlock.layers() splits a block whose tensors tile its payload (in any order: 11 layers put layer.10 before
    layer.2) in one call, and views one laid out with gaps tensor by tensor: the same values, and no copy either way."""
    import dataclasses

    heads, dim, layers = 2, 8, 11
    kv = make_kv(layers=layers, tokens=BS, heads=heads, head_dim=dim, seed=4, dtype=torch.bfloat16)
    ids = list(range(3, 3 + BS))
    pc, ns = PrefixCache(MemoryStore(), SECRET, BS), Namespace("acme", "m")
    pc.publish(ns, ids, kv)
    block = pc.lookup(ns, ids, layers, heads, dim).blocks[0]
    size = block.nbytes
    gapped = dataclasses.replace(
        block,
        data=memoryview(bytes(size) + bytes(block.data)),  # every tensor moved on by one
        offsets=tuple((k + size, v + size) for k, v in block.offsets),
    )
    assert block.tiled and not gapped.tiled
    for b in (block, gapped):
        base = torch.frombuffer(b.data, dtype=torch.uint8).data_ptr()
        for (k, v), (wk, wv), (ok, ov) in zip(b.layers(), kv, b.offsets):
            assert torch.equal(k, wk[0]) and torch.equal(v, wv[0])
            assert (k.data_ptr() - base, v.data_ptr() - base) == (ok, ov)  # views of the blob's bytes


def test_format_1_blobs_stay_readable_and_lying_headers_are_refused():
    import hashlib
    import json
    import zlib

    from kvferry.common.prefix import MAGIC, MAGIC_V1, MAGIC_V2

    layers = [tuple(t[0] for t in kv) for kv in make_kv(layers=2, tokens=8, heads=2, head_dim=16)]
    h = b"\x01" * 32
    blob = encode_block(layers, h, 8)
    payload = blob[len(MAGIC) + 8 :]
    v1 = MAGIC_V1 + hashlib.sha256(payload).digest() + payload
    for got in (decode_block(blob, h, 2, (2, 8, 16)), decode_block(v1, h, 2, (2, 8, 16))):
        torch.testing.assert_close(got[1][0], layers[1][0])
    n = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + n])
    good = header["layer.0.k"]["data_offsets"]
    lies = {
        "past the blob": [0, 10**9],
        "float offsets": [float(good[0]), float(good[1])],
        "wrong size": [good[0], good[1] - 2],
    }
    for _what, offsets in lies.items():
        header["layer.0.k"]["data_offsets"] = offsets
        text = json.dumps(header).encode()
        text += b" " * (n - len(text)) if len(text) <= n else b""
        forged = len(text).to_bytes(8, "little") + text + payload[8 + n :]
        with pytest.raises(CorruptBlock, match="offsets"):  # a hit sends byte ranges: every offset is checked
            decode_block(MAGIC_V2 + zlib.crc32(forged).to_bytes(4, "little") + forged, h, 2, (2, 8, 16))


def test_a_header_seen_before_is_still_checked_against_this_block():
    """Verified headers are remembered without their block hash (the JSON parse is skipped for the next block of the
    same map): a blob read under another block's hash, a payload cut short under a remembered header (checksum
    recomputed), and a header that names the hash twice are still refused or fully parsed."""
    import json

    from kvferry.common.prefix import MAGIC, read_block

    layers = [tuple(t[0] for t in kv) for kv in make_kv(layers=2, tokens=8, heads=2, head_dim=16, seed=3)]
    h1, h2 = b"\x07" * 32, b"\x08" * 32
    one, two = encode_block(layers, h1, 8), encode_block(layers, h2, 8)
    for _ in range(2):  # the second time from the remembered header
        assert read_block(one, h1, 2, (2, 8, 16)).offsets == read_block(two, h2, 2, (2, 8, 16)).offsets
        with pytest.raises(CorruptBlock, match="metadata"):
            read_block(one, h2, 2, (2, 8, 16))  # a blob moved to another block's key
        with pytest.raises(CorruptBlock):
            read_block(one, h1, 3, (2, 8, 16))  # another layer count
    payload = one[len(MAGIC) + 8 :]
    short = payload[:-16]
    import xxhash

    with pytest.raises(CorruptBlock, match="offsets"):
        read_block(MAGIC + xxhash.xxh3_64_intdigest(short).to_bytes(8, "little") + short, h1, 2, (2, 8, 16))
    n = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + n])
    header["__metadata__"]["format"] = h1.hex()  # the hash twice: no template, the full parse decides
    text = json.dumps(header).encode()
    forged = len(text).to_bytes(8, "little") + text + payload[8 + n :]
    got = read_block(MAGIC + xxhash.xxh3_64_intdigest(forged).to_bytes(8, "little") + forged, h1, 2, (2, 8, 16))
    assert got.offsets == read_block(one, h1, 2, (2, 8, 16)).offsets


def test_memory_store_is_bounded_and_expires():
    s = MemoryStore(max_bytes=100)
    assert s.put_many([("a", b"x" * 40), ("b", b"y" * 40)], ttl=60) == 2
    s.put_many([("c", b"z" * 40)], ttl=60)  # evicts the least recently used
    assert s.get_many(["a", "b", "c"]) == [None, b"y" * 40, b"z" * 40] and s.nbytes == 80
    s.put_many([("d", b"w")], ttl=0.05)
    wait_until(lambda: s.get_many(["d"]) == [None], 5, "the entry's expiry")


def test_redis_store_set_if_absent_and_ttl(redis_url):
    s = RedisStore(redis_url)
    assert s.put_many([("k", b"first")], ttl=60) == 1
    assert s.put_many([("k", b"second")], ttl=60) == 0  # concurrent writers: the first value stands, whole
    assert s.get_many(["k", "missing"]) == [b"first", None]
    s.put_many([("short", b"v")], ttl=0.1)
    assert s.get_many(["short"]) == [b"v"]
    wait_until(lambda: s.get_many(["short"]) == [None], 5, "Redis's expiry")
    with pytest.raises(StoreUnavailable, match="unreachable"):
        RedisStore("redis://127.0.0.1:1/0", timeout=0.2).get_many(["k"])


def test_concurrent_writers_do_not_corrupt(redis_url):
    pc = PrefixCache(RedisStore(redis_url), SECRET, BS)
    ns = Namespace("t", "m")
    ids = list(range(64))
    kv = make_kv(layers=2, tokens=64, heads=2, head_dim=8)
    threads = [threading.Thread(target=pc.publish, args=(ns, ids, kv)) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    look = pc.lookup(ns, ids, 2, 2, 8)
    assert len(look.blocks) == 4 and look.corrupt == 0
    torch.testing.assert_close(look.layers()[1][0], kv[1][0])


@pytest.fixture
def maps_dir(tmp_path, family):
    save(identity_mapset(family["S"].identity, version="1.0.0"), tmp_path)
    return tmp_path


def _sidecar(factory, maps_dir, **kw):
    kw.setdefault("prefix_block_size", BS)
    return factory(maps_dir=str(maps_dir), force_maps=True, prefix_secret=SECRET.decode(), **kw)


def _kw(family):
    s = family["S"].identity
    return dict(source_geometry=s.geometry.fingerprint, tokenizer=s.tokenizer)


def test_prefix_reuse_across_lengths_and_tenants(sidecar_factory, maps_dir, family, redis_url):
    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url, prefix_write_back=True)  # trusted callers publish
    kv = make_kv(layers=4, tokens=80, heads=2, head_dim=32, seed=3)
    ids = list(range(100, 180))
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        short = [(k[:, :, :48], v[:, :, :48]) for k, v in kv]
        first = c.translate(short, "S__S-self", token_ids=ids[:48], tenant="acme", **_kw(family))
        assert first.stats.cached_blocks == 0
        _wait_for_writes(sc, 3)
        longer = c.translate(kv, "S__S-self", token_ids=ids, tenant="acme", **_kw(family))
        assert longer.stats.cached_blocks == 3  # the shared 48-token prefix came from Redis
        for (k, _v), (tk, _tv) in zip(kv, longer.layers()):
            torch.testing.assert_close(tk, k, rtol=1e-5, atol=1e-5)
        other = c.translate(kv, "S__S-self", token_ids=ids, tenant="globex", **_kw(family))
        assert other.stats.cached_blocks == 0  # another tenant never sees acme's blocks


def _wait_for_writes(sc, n, timeout=10.0):
    wait_until(lambda: sample(sc, "kvferry_prefix_writes_total") >= n, timeout, "the mapped blocks' write-back")


def test_key_only_translation_from_published_source(sidecar_factory, maps_dir, family, redis_url, monkeypatch):
    import kvferry.sidecar.prefix_flow as flow

    threads = []

    def watched(*args, **kw):  # the real apply(), noting where it ran: map compute belongs on the compute thread
        threads.append(threading.current_thread().name)
        return real_apply(*args, **kw)

    real_apply = flow.apply
    monkeypatch.setattr(flow, "apply", watched)
    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url)
    kv = make_kv(layers=4, tokens=70, heads=2, head_dim=32, seed=4)
    ids = list(range(7, 77))
    key = publish_source(
        kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, tenant="acme", block_size=BS
    )
    assert key
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        res = c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family))
        assert res.info.num_tokens == 64 and res.stats.cached_blocks == 0  # 4 full blocks, mapped from Redis
        assert threads and all(t.startswith("kvferry-compute") for t in threads), threads  # not the default executor
        for (k, _v), (tk, _tv) in zip(kv, res.layers()):
            torch.testing.assert_close(tk, k[:, :, :64], rtol=1e-5, atol=1e-5)
        again = c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family))
        assert again.stats.cached_blocks == 4 and again.stats.compute_seconds == 0  # pure hits on the second pod's ask
        with pytest.raises(grpc.RpcError) as e:
            c.translate(None, "S__S-self", token_ids=ids, tenant="globex", prefix_key=key, **_kw(family))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_key_only_hit_starts_no_thread_per_call(sidecar_factory, maps_dir, family, redis_url, monkeypatch):
    """The blocking client receives TranslateByKey's messages on the calling thread (client.SINGLE_THREADED_STREAMS):
    no helper thread is started per call to hand each message over, and the answer is the same."""
    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url)
    kv = make_kv(layers=4, tokens=70, heads=2, head_dim=32, seed=6)
    ids = list(range(5, 75))
    key = publish_source(
        kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, tenant="acme", block_size=BS
    )
    started = []
    real_start = threading.Thread.start

    def noting_start(self):
        started.append(self.name)
        real_start(self)

    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        first = c.translate(
            None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family)
        )  # maps, stores
        monkeypatch.setattr(threading.Thread, "start", noting_start)
        hits = [
            c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family))
            for _ in range(3)
        ]
        monkeypatch.undo()
    assert started == []
    for hit in hits:
        assert hit.stats.cached_blocks == 4
        for (k, v), (hk, hv) in zip(first.layers(), hit.layers()):
            assert torch.equal(k, hk) and torch.equal(v, hv)


def test_translate_by_key_answers_exactly_what_translate_answers(sidecar_factory, maps_dir, family, redis_url):
    """TranslateByKey is a key-only Translate in one message: the same header and block bytes, the same trailer counts,
    the same status where nothing is stored; and its request is the bytes of a TranslateRequest with that header."""
    from kvferry.client.client import BY_KEY_METHOD, TRANSLATE_METHOD, make_spec
    from kvferry.common import wire
    from kvferry.v1 import translate_pb2 as pb

    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url)
    kv = make_kv(layers=4, tokens=70, heads=2, head_dim=32, seed=5)
    ids = list(range(9, 79))
    key = publish_source(
        kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, tenant="acme", block_size=BS
    )
    header = wire.spec_to_pb(
        make_spec([], "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family))
    ).header
    as_stream = pb.TranslateRequest(header=header).SerializeToString()
    as_one = pb.TranslateByKeyRequest(header=header).SerializeToString()
    assert as_one == as_stream
    with grpc.insecure_channel(sc.address) as ch:  # raw bytes both ways
        stream, by_key = ch.stream_stream(TRANSLATE_METHOD), ch.unary_stream(BY_KEY_METHOD)
        miss = list(by_key(as_one, timeout=30))  # maps the stored source blocks and stores the target's
        hits = list(stream(iter([as_stream]), timeout=30)), list(by_key(as_one, timeout=30))
        assert hits[0][:-1] == hits[1][:-1] and hits[0][0] == miss[0]  # header and every block, byte for byte
        trailers = [pb.TranslateResponse.FromString(h[-1]).trailer for h in (miss, *hits)]
        counts = [(t.tokens, t.cached_blocks, t.blocks, t.bytes_out) for t in trailers]
        assert counts[0][:2] == (64, 0) and counts[1] == counts[2] and counts[1][:2] == (64, 4)
        blocks = [wire.decode_response(m) for m in hits[1][1:-1]]
        first = next(b for b in blocks if b.layer == 0 and b.start == 0)
        torch.testing.assert_close(first.key, kv[0][0][0, :, : first.end], rtol=1e-5, atol=1e-5)  # the identity map
        codes = []
        for req in (
            pb.TranslateByKeyRequest(
                header=_with_fields(header, tenant="globex")
            ).SerializeToString(),  # another tenant
            pb.TranslateByKeyRequest(header=_with_fields(header, prefix_key="")).SerializeToString(),  # no key
            b"\xff\xff\xff",
        ):  # no message at all
            with pytest.raises(grpc.RpcError) as e:
                list(by_key(req, timeout=30))
            codes.append((e.value.code(), e.value.details()))
        with pytest.raises(grpc.RpcError) as e:
            list(
                stream(
                    iter([pb.TranslateRequest(header=_with_fields(header, tenant="globex")).SerializeToString()]),
                    timeout=30,
                )
            )
    assert codes[0] == (e.value.code(), e.value.details()) and codes[0][0] == grpc.StatusCode.NOT_FOUND
    assert codes[1][0] == grpc.StatusCode.INVALID_ARGUMENT and "prefix_key" in codes[1][1]
    assert codes[2][0] == grpc.StatusCode.INVALID_ARGUMENT and "TranslateByKeyRequest" in codes[2][1]


def _with_fields(header, **fields):
    """A copy of protobuf message ``header`` with ``fields`` set."""
    out = type(header)()
    out.CopyFrom(header)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def test_the_client_falls_back_to_translate_on_a_sidecar_without_translate_by_key(
    sidecar_factory, maps_dir, family, redis_url, monkeypatch
):
    """A sidecar from before TranslateByKey answers UNIMPLEMENTED: the client sends the same header through Translate,
    without spending a retry, and remembers it for that endpoint."""
    import kvferry.sidecar.server as server

    real = server.translate_handlers

    def older(servicer):  # the same sidecar without the method
        handlers = real(servicer)

        class Older(grpc.GenericRpcHandler):
            def service(self, details):
                return None if details.method.endswith("/TranslateByKey") else handlers.service(details)

        return Older()

    monkeypatch.setattr(server, "translate_handlers", older)
    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url)
    kv = make_kv(layers=4, tokens=70, heads=2, head_dim=32, seed=6)
    ids = list(range(11, 81))
    key = publish_source(kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, block_size=BS)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        first = c.translate(None, "S__S-self", token_ids=ids, prefix_key=key, **_kw(family))
        assert c.endpoints.has_by_key == [False] and first.attempts == 1 and first.stats.cached_blocks == 0
        again = c.translate(None, "S__S-self", token_ids=ids, prefix_key=key, **_kw(family))
        assert again.stats.cached_blocks == 4
        torch.testing.assert_close(again.layers()[2][1], kv[2][1][:, :, :64])
    assert sample(sc, "kvferry_requests_total", method="Translate", code="OK") == 2


def test_all_tensor_work_runs_on_the_compute_thread(sidecar_factory, maps_dir, family, redis_url, monkeypatch):
    """Loading maps, building sessions, casting, joining and paging stored blocks, mapping and encoding for the store:
    every sidecar call that touches tensor data runs on its one compute thread. A second thread that enters a torch
    parallel region once slows every later map on the compute thread to about one core (sidecar/compute.py)."""
    import kvferry.sidecar.prefix_flow as flow
    from kvferry.common.prefix_cache import Lookup
    from kvferry.sidecar.compute import THREAD_NAME
    from kvferry.sidecar.pipeline import TranslateSession
    from kvferry.sidecar.registry import MapRegistry

    seen: list[tuple[str, str]] = []
    watched = [
        (MapRegistry, "scan"),
        (TranslateSession, "__init__"),
        (TranslateSession, "initial_blocks"),
        (TranslateSession, "add"),
        (TranslateSession, "output_layers"),
        (PrefixCache, "encode_blocks"),
        (Lookup, "layers"),
        (flow, "apply"),
    ]

    def watching(real, name):
        def watch(*a, **kw):
            if threading.current_thread() is not threading.main_thread():  # the test's own calls are the client's
                seen.append((name, threading.current_thread().name))
            return real(*a, **kw)

        return watch

    for owner, name in watched:
        monkeypatch.setattr(owner, name, watching(getattr(owner, name), name))
    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url, prefix_write_back=True)
    kv = make_kv(layers=4, tokens=48, heads=2, head_dim=32, seed=9)
    ids = list(range(300, 348))
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        c.translate(kv, "S__S-self", token_ids=ids, **_kw(family))  # a miss, written back
        _wait_for_writes(sc, 3)
        assert c.translate(kv, "S__S-self", token_ids=ids, **_kw(family)).stats.cached_blocks == 3  # sent as stored
        assert (
            c.translate(kv, "S__S-self", token_ids=ids, layout="paged", block_size=8, **_kw(family)).stats.cached_blocks
            == 3
        )
        cast = c.translate(kv, "S__S-self", token_ids=ids, target_dtype=torch.bfloat16, **_kw(family))
        assert cast.stats.cached_blocks == 3 and cast.layers()[0][0].dtype == torch.bfloat16
        more = list(range(400, 448))
        key = publish_source(kv, more, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, block_size=BS)
        assert c.translate(None, "S__S-self", token_ids=more, prefix_key=key, **_kw(family)).info.num_tokens == 48
    assert {name for name, _ in seen} == {name for _, name in watched}  # every path above ran
    off = sorted({(name, thread) for name, thread in seen if not thread.startswith(THREAD_NAME)})
    assert not off, f"tensor work off the compute thread: {off}"


def test_corrupt_blob_is_a_miss(sidecar_factory, maps_dir, family, redis_url, redis_server):
    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url, prefix_write_back=True)
    kv = make_kv(layers=4, tokens=32, heads=2, head_dim=32, seed=5)
    ids = list(range(32))
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        c.translate(kv, "S__S-self", token_ids=ids, **_kw(family))
        _wait_for_writes(sc, 2)
        for key in redis_server.client.keys("kvf:*"):
            blob = bytearray(redis_server.client.get(key))
            blob[-1] ^= 0xFF
            redis_server.client.set(key, bytes(blob))
        res = c.translate(kv, "S__S-self", token_ids=ids, **_kw(family))
    assert res.stats.cached_blocks == 0
    assert sample(sc, "kvferry_prefix_blocks_total", outcome="corrupt") >= 1
    torch.testing.assert_close(res.layers()[0][0], kv[0][0], rtol=1e-5, atol=1e-5)


def test_redis_down_then_back(sidecar_factory, maps_dir, family, redis_url, redis_server):
    sc = _sidecar(
        sidecar_factory, maps_dir, redis_url=redis_url, prefix_store_cooldown_seconds=0
    )  # every call tries it
    kv = make_kv(layers=4, tokens=32, heads=2, head_dim=32, seed=6)
    ids = list(range(32))
    key = publish_source(kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, block_size=BS)
    redis_server.stop()
    with TranslateClient(ClientOptions(target=sc.address, timeout=20, retry=Retry(retries=0))) as c:
        res = c.translate(kv, "S__S-self", token_ids=ids, **_kw(family))  # streamed KV: still served
        torch.testing.assert_close(res.layers()[3][1], kv[3][1])
        assert sample(sc, "kvferry_prefix_store_errors_total") >= 1
        with pytest.raises(grpc.RpcError) as e:
            c.translate(None, "S__S-self", token_ids=ids, prefix_key=key, **_kw(family))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "unreachable" in e.value.details()
        host_port = redis_url.split("://", 1)[1].split("/", 1)[0].rpartition("@")[2]
        assert host_port not in e.value.details() and "the prefix store" in e.value.details()  # no address to callers
        redis_server.restart()
        publish_source(kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, block_size=BS)
        res = c.translate(None, "S__S-self", token_ids=ids, prefix_key=key, **_kw(family))  # reconnected on its own
        assert res.info.num_tokens == 32


def test_in_memory_default(sidecar_factory, maps_dir, family):
    sc = sidecar_factory(
        maps_dir=str(maps_dir), force_maps=True, prefix_block_size=BS, prefix_write_back=True
    )  # no redis_url
    kv = make_kv(layers=4, tokens=40, heads=2, head_dim=32, seed=7)
    ids = list(range(40))
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        assert c.translate(kv, "S__S-self", token_ids=ids, **_kw(family)).stats.cached_blocks == 0
        _wait_for_writes(sc, 2)
        assert (
            c.translate(kv, "S__S-self", token_ids=ids, **_kw(family), layout="paged", block_size=8).stats.cached_blocks
            == 2
        )


def _published(family, redis_url, tokens, seed, first_id):
    """A source cache of ``tokens`` tokens published for tenant acme: (kv, token ids, prefix key)."""
    kv = make_kv(layers=4, tokens=tokens, heads=2, head_dim=32, seed=seed)
    ids = list(range(first_id, first_id + tokens))
    key = publish_source(
        kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, tenant="acme", block_size=BS
    )
    return kv, ids, key


def _flip_a_byte(client, key):
    blob = bytearray(client.get(key))
    blob[-3] ^= 0x55
    client.set(key, bytes(blob))


def test_a_corrupt_blob_is_replaced_by_a_good_copy(sidecar_factory, maps_dir, family, redis_url, redis_server):
    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url)
    _kv, ids, key = _published(family, redis_url, 64, 9, 500)
    before = set(redis_server.client.keys("kvf:*"))
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:

        def ask():
            return c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family))

        mapped = ask()
        target_keys = sorted(set(redis_server.client.keys("kvf:*")) - before)
        assert len(target_keys) == 4
        assert ask().stats.cached_blocks == 4
        _flip_a_byte(
            redis_server.client, target_keys[1]
        )  # writes never overwrite: without healing it would stay corrupt
        res = ask()
        assert res.stats.cached_blocks < 4  # the corrupt block and the rest were mapped again
        for (k, v), (hk, hv) in zip(mapped.layers(), res.layers()):
            assert torch.equal(k, hk) and torch.equal(v, hv)
        assert sample(sc, "kvferry_prefix_blocks_total", outcome="corrupt") >= 1
        assert ask().stats.cached_blocks == 4  # the corrupt blob was deleted and a good copy written in its place


def test_direct_reads_serve_full_hits_without_the_sidecar(sidecar_factory, maps_dir, family, redis_url, redis_server):
    from kvferry.client.direct import DirectReader

    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url)
    _kv, ids, key = _published(family, redis_url, 72, 10, 900)
    source_keys = set(redis_server.client.keys("kvf:acme:*"))
    direct = DirectReader(RedisStore(redis_url), SECRET, BS)

    def served():
        return sample(sc, "kvferry_tokens_total", map="S__S-self@1.0.0")

    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0)), direct=direct) as c:

        def ask(**kw):
            return c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family), **kw)

        first = ask()  # nothing mapped yet: the sidecar maps the stored source blocks and writes them back
        assert first.attempts == 1 and first.stats.cached_blocks == 0 and first.info.num_tokens == 64
        before = served()
        hit = ask()
        assert hit.attempts == 0 and hit.stats.extra["path"] == "direct" and hit.stats.cached_blocks == 4
        assert served() == before  # the sidecar did not see it
        assert (hit.info.num_tokens, hit.info.layers, hit.info.dtype) == (
            first.info.num_tokens,
            first.info.layers,
            first.info.dtype,
        )
        for (k, v), (hk, hv) in zip(first.layers(), hit.layers()):
            assert torch.equal(k, hk) and torch.equal(v, hv)
        # Nothing joined: a block per stored block and layer, layer by layer, viewing that block's fetched bytes.
        assert [(b.layer, b.start, b.end, b.index) for b in hit.blocks] == [
            (layer, j * BS, (j + 1) * BS, j) for layer in range(4) for j in range(4)
        ]

        def storage(b):
            return b.key.untyped_storage().data_ptr()

        assert len({storage(b) for b in hit.blocks}) == 4 and all(
            storage(b) == storage(b2) and b.value.untyped_storage().data_ptr() == storage(b)
            for b in hit.blocks
            for b2 in hit.blocks
            if b.index == b2.index
        )
        cast = ask(target_dtype=torch.bfloat16)  # another dtype: converted, joined per layer
        assert cast.attempts == 0 and [(b.layer, b.start, b.end) for b in cast.blocks] == [(l, 0, 64) for l in range(4)]
        for (k, v), (ck, cv) in zip(first.layers(), cast.layers()):
            assert torch.equal(k.to(torch.bfloat16), ck) and torch.equal(v.to(torch.bfloat16), cv)
        assert ask(layout="paged", block_size=8).attempts == 1  # pages come from the sidecar

        _flip_a_byte(redis_server.client, sorted(set(redis_server.client.keys("kvf:acme:*")) - source_keys)[2])
        again = ask()  # a corrupt (or missing) block: not served directly; the sidecar's answer is still right
        assert again.attempts == 1 and direct.corrupt == 1
        for (k, _), (hk, _) in zip(first.layers(), again.layers()):
            assert torch.equal(k, hk)
        with pytest.raises(grpc.RpcError) as e:  # another tenant's key: nothing read directly, the sidecar refuses
            c.translate(None, "S__S-self", token_ids=ids, tenant="globex", prefix_key=key, **_kw(family))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_async_client_reads_direct_hits_too(sidecar_factory, maps_dir, family, redis_url):
    import asyncio

    from kvferry.client.client import AsyncTranslateClient
    from kvferry.client.direct import DirectReader

    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url)
    kv = make_kv(layers=4, tokens=32, heads=2, head_dim=32, seed=11)
    ids = list(range(32))
    key = publish_source(kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, block_size=BS)

    async def main():
        async with AsyncTranslateClient(
            ClientOptions(target=sc.address, retry=Retry(retries=0)),
            direct=DirectReader(RedisStore(redis_url), SECRET, BS),
        ) as c:
            first = await c.translate(None, "S__S-self", token_ids=ids, prefix_key=key, **_kw(family))
            second = await c.translate(None, "S__S-self", token_ids=ids, prefix_key=key, **_kw(family))
            return first, second

    first, second = asyncio.run(main())
    assert (first.attempts, second.attempts) == (1, 0)
    assert torch.equal(first.layers()[1][1], second.layers()[1][1])


def test_a_full_or_denying_redis_is_a_clean_status_never_internal(
    sidecar_factory, maps_dir, family, redis_url, redis_server
):
    """A full Redis (maxmemory, noeviction) used to fail key-only requests with INTERNAL and send the Redis key and
    raw blob bytes to the caller; an ACL denial failed even streamed requests with INTERNAL."""
    kv = make_kv(layers=4, tokens=32, heads=2, head_dim=32, seed=8)
    ids = list(range(300, 332))
    key = publish_source(kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, block_size=BS)
    r = redis_server.client
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(used))  # full: the write-back of the mapped blocks is refused (OOM)
    try:
        sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url)
        with TranslateClient(ClientOptions(target=sc.address, timeout=20, retry=Retry(retries=0))) as c:
            res = c.translate(None, "S__S-self", token_ids=ids, prefix_key=key, **_kw(family))  # mapped from source
            torch.testing.assert_close(res.layers()[2][0], kv[2][0])
        assert sample(sc, "kvferry_prefix_store_errors_total") >= 1
    finally:
        r.config_set("maxmemory", "0")
    r.acl_setuser("deny", enabled=True, passwords=["+deny-pass"], commands=["-@all", "+auth", "+hello", "+ping"])
    try:
        denied_url = redis_url.replace("redis://", "redis://deny:deny-pass@")
        sc = _sidecar(sidecar_factory, maps_dir, redis_url=denied_url)
        with TranslateClient(ClientOptions(target=sc.address, timeout=20, retry=Retry(retries=0))) as c:
            res = c.translate(kv, "S__S-self", token_ids=ids, **_kw(family))  # streamed: served without the store
            torch.testing.assert_close(res.layers()[1][1], kv[1][1])
            with pytest.raises(grpc.RpcError) as e:
                c.translate(None, "S__S-self", token_ids=ids, prefix_key=key, **_kw(family))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (
            "NoPermissionError" in e.value.details()
            and "kvf:" not in e.value.details()
            and "\\x" not in e.value.details()
        )
    finally:
        r.acl_deluser("deny")


def test_a_callers_claim_never_becomes_another_callers_answer(sidecar_factory, maps_dir, family):
    """Cache poisoning within a tenant (found by attacking the sidecar): caller X streams fabricated KV under some
    token ids; caller Y later streams the real KV for the same ids. By default streamed translations are not
    written back, so Y gets the translation of its own KV; with prefix_write_back (trusted publishers only) the
    stored blocks are reused, as documented."""
    ids = list(range(500, 532))
    real = make_kv(layers=4, tokens=32, heads=2, head_dim=32, seed=21)
    fake = [(k * 0 + 7.0, v * 0 - 7.0) for k, v in real]
    for write_back, poisoned in ((False, False), (True, True)):
        sc = sidecar_factory(
            maps_dir=str(maps_dir), force_maps=True, prefix_block_size=BS, prefix_write_back=write_back
        )
        with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
            c.translate(fake, "S__S-self", token_ids=ids, **_kw(family))  # caller X
            if write_back:
                _wait_for_writes(sc, 2)
            wait_until(lambda: sc.sidecar.servicer.flow.settled, 10, "the first call's write-back, if any")
            got = c.translate(real, "S__S-self", token_ids=ids, **_kw(family))  # caller Y, same tenant
        assert (got.stats.cached_blocks == 2) == poisoned
        assert torch.allclose(got.layers()[0][1], fake[0][1], atol=1e-4) == poisoned  # values: no RoPE round trip
        if not poisoned:
            torch.testing.assert_close(got.layers()[3][1], real[3][1])


def test_key_only_requests_are_sized_before_any_store_work(sidecar_factory, maps_dir, family, redis_url):
    """Key-only requests used to read, map and write every block before --max-tokens was checked."""
    kv = make_kv(layers=4, tokens=70, heads=2, head_dim=32, seed=4)
    ids = list(range(7, 77))
    key = publish_source(
        kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=SECRET, tenant="acme", block_size=BS
    )
    sc = _sidecar(sidecar_factory, maps_dir, redis_url=redis_url, max_tokens=48)
    with (
        TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c,
        pytest.raises(grpc.RpcError) as e,
    ):
        c.translate(None, "S__S-self", token_ids=ids, tenant="acme", prefix_key=key, **_kw(family))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 48" in e.value.details()
    assert sample(sc, "kvferry_prefix_writes_total") == 0


GOLDEN = Path(__file__).parent / "golden" / "prefix_v2"


def test_golden_key_derivation():
    """Prefix keys outlive every process: a change here silently orphans every stored prefix, so the committed keys
    (tenant acme, 40 tokens in blocks of 16, a map namespace and its source) must come out exactly."""
    g = json.loads((GOLDEN / "keys.json").read_text())
    src, tgt = map_namespaces(g["tenant"], g["source_model"], g["target_model"], g["map_id"])
    secret = g["secret"].encode()
    assert [src.key(h) for h in block_hashes(secret, src, g["token_ids"], g["block_size"])] == g["keys"]["source"]
    assert [tgt.key(h) for h in block_hashes(secret, tgt, g["token_ids"], g["block_size"])] == g["keys"]["mapped"]
    assert all(re.fullmatch(r"kvf:acme:[0-9a-f]{64}", k) for k in g["keys"]["source"] + g["keys"]["mapped"])


def _golden_layers():
    return [
        (
            torch.arange(64, dtype=torch.float32).reshape(2, 4, 8) / 7 + l,
            -torch.arange(64, dtype=torch.float32).reshape(2, 4, 8) / 3 - l,
        )
        for l in range(2)
    ]


def test_golden_block_bytes():
    """The blob format (KVFB3: xxh3-64 + safetensors) is written as committed and read back; the format-2 blob
    (KVFB2: CRC-32) committed before it, and a format-1 blob (KVFB1: SHA-256) of the same payload, still decode."""
    import hashlib

    from kvferry.common.prefix import MAGIC, MAGIC_V1, MAGIC_V2

    h = bytes(range(32))
    v3, v2 = (GOLDEN / "block_v3.bin").read_bytes(), (GOLDEN / "block.bin").read_bytes()
    fresh = encode_block(_golden_layers(), h, 4)
    # safetensors writes its header's metadata in hash-map order, so the checksum and the header's key order may
    # differ between processes; the header's content and the data section may not
    assert len(fresh) == len(v3) and fresh[:6] == v3[:6] == MAGIC and v2[:6] == MAGIC_V2

    def parts(b: bytes, skip: int):
        p = b[len(MAGIC) + skip :]
        n = int.from_bytes(p[:8], "little")
        return json.loads(p[8 : 8 + n]), p[8 + n :]

    assert parts(fresh, 8) == parts(v3, 8) == parts(v2, 4)
    for blob in (v3, v2):
        for want, got in zip(_golden_layers(), decode_block(blob, h, 2, (2, 4, 8))):
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    payload = v2[len(MAGIC_V2) + 4 :]
    v1 = MAGIC_V1 + hashlib.sha256(payload).digest() + payload
    assert torch.equal(decode_block(v1, h, 2, (2, 4, 8))[1][1], _golden_layers()[1][1])


@pytest.mark.parametrize(
    "secret_url",
    [
        "redis://default:pa@ss-Word-1@127.0.0.1:{port}/0",
        "redis://127.0.0.1:{port}/0?password=pa@ss-Word-1&db=0",
        "redis://127.0.0.1:{port}/0?username=default&password=pa@ss-Word-1",
    ],
)
def test_credentials_in_the_url_never_reach_a_caller_or_the_log(sidecar_factory, maps_dir, family, secret_url, caplog):
    """Redis down, a key-only caller gets UNAVAILABLE naming "the prefix store", without its address; the sidecar's
    log names the store's address for the operator, without the password, whichever form the URL gave it in (userinfo
    with an '@' inside, a query parameter)."""
    import logging
    import socket

    with socket.socket() as s:  # a port nothing listens on: the store is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from kvferry.common.stores import MemoryStore

    sc = _sidecar(sidecar_factory, maps_dir, redis_url=secret_url.format(port=port))
    kv, ids = make_kv(layers=4, tokens=32, heads=2, head_dim=32, seed=6), list(range(32))
    key = publish_source(kv, ids, family["S"].identity, store=MemoryStore(), secret=SECRET, block_size=BS)
    caplog.set_level(logging.DEBUG)
    with (
        TranslateClient(ClientOptions(target=sc.address, timeout=20, retry=Retry(retries=0))) as c,
        pytest.raises(grpc.RpcError) as e,
    ):
        c.translate(None, "S__S-self", token_ids=ids, prefix_key=key, **_kw(family))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "the prefix store is unreachable" in e.value.details()
    assert f"127.0.0.1:{port}" not in e.value.details() and f"127.0.0.1:{port}" in caplog.text
    for text in (e.value.details(), caplog.text):
        assert "Word-1" not in text and "pa@ss" not in text


def test_redact_url():
    from kvferry.common.urls import redact_url

    assert redact_url("redis://u:p@ss@h:1/0") == "redis://***@h:1/0"
    assert (
        redact_url("rediss://h:1/0?password=x&db=2&ssl_cert_reqs=none")
        == "rediss://h:1/0?password=***&db=2&ssl_cert_reqs=none"
    )
    assert (
        redact_url("unix:///run/redis.sock?Username=a&PASSWORD=b") == "unix:///run/redis.sock?Username=***&PASSWORD=***"
    )
    assert redact_url("redis://h:6379") == "redis://h:6379"
    assert redact_url("redis://[::1") == "<unparseable URL>"
    with pytest.raises(ValueError, match=r"Password=\*\*\*' has a parameter redis-py does not accept \('Password'\)"):
        RedisStore("redis://h:1/0?Password=secret-1")


@pytest.mark.parametrize(
    "url",
    [
        "redis://kvf:6379/pw-secret@h",
        "redis://:pa#secret@h:6379/0",
        "redis://:pa/secret@h:6379/0",
        "redis://:pa?secret@h:6379/0",
        "redis://h:port-secret/0",
        "redis+cluster://a:1,b:secret",
    ],
)
def test_a_store_url_read_otherwise_than_it_looks_is_refused_without_echo(url):
    """One parser decides: a '#', a path that is no database number, a port that is no number or a parameter
    without a value is refused wherever a store URL is read, and no message or log line shows any of it."""
    from kvferry.client.connector_config import ConnectorConfig
    from kvferry.common.urls import check_store_url, redact_url
    from kvferry.sidecar.config import SidecarConfig

    assert redact_url(url) == "<unparseable URL>"
    with pytest.raises(ValueError) as e:
        check_store_url(url)
    assert "secret" not in str(e.value)
    with pytest.raises(ValueError) as e:
        RedisStore(url)
    assert "secret" not in str(e.value)
    with pytest.raises(InvalidInput, match="redis_url: the prefix store URL") as e:
        SidecarConfig(redis_url=url, prefix_secret="x" * 32)
    assert "secret@" not in str(e.value) and "pw-secret" not in str(e.value)
    with pytest.raises(InvalidInput, match="redis_url") as e:
        ConnectorConfig.from_extra({"redis_url": url, "prefix_secret": "x" * 32})
    assert "pw-secret" not in str(e.value)


def test_percent_encoded_credential_names_are_read_as_redis_py_reads_them():
    from kvferry.common.urls import redact_url

    assert redact_url("redis://h:1/0?p%61ssword=hunter2") == "redis://h:1/0?password=***"
    assert redact_url("redis://h:1/0?%70assword=hunter2&db=1") == "redis://h:1/0?password=***&db=1"
    assert redact_url("redis+cluster://u:p@a:1,b:2/?password=x") == "redis+cluster://***@a:1,b:2/?password=***"


def test_stored_blocks_do_not_depend_on_who_asked_first(sidecar_factory, family, redis_url, tmp_path):
    """A bfloat16 caller asks first for a published prefix; a float32 caller then gets exactly what the map computes
    in float32 (the stored blocks hold the map's own precision), and the bfloat16 caller what it would compute. A
    first caller's source_dtype changes nothing either: the stored source blocks are mapped as published."""
    from kvferry.mappings.apply import apply
    from kvferry.mappings.artifact import load

    ms = load(ROOT / "maps" / "S__T" / "1.0.0")  # a real cross-model map (float32): its outputs are not bf16-exact
    sc = sidecar_factory(
        maps_dir=str(ROOT / "maps"),
        force_maps=True,
        prefix_secret=SECRET.decode(),
        prefix_block_size=BS,
        redis_url=redis_url,
    )
    g = ms.source.geometry
    kv = make_kv(layers=g.layers, tokens=64, heads=g.kv_heads, head_dim=g.head_dim, seed=11)
    ids = list(range(500, 564))
    key = publish_source(kv, ids, ms.source, store=RedisStore(redis_url), secret=SECRET, tenant="acme", block_size=BS)
    want = apply(ms, kv, 0)
    kw = dict(
        token_ids=ids, tenant="acme", prefix_key=key, source_geometry=g.fingerprint, tokenizer=ms.source.tokenizer
    )
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        for dt, src_dt in (
            (torch.bfloat16, torch.bfloat16),
            (torch.float16, torch.float16),
            (torch.float32, None),
            (torch.bfloat16, None),
        ):  # the first callers also claim a lower source precision
            res = c.translate(None, "S__T", "1.0.0", target_dtype=dt, source_dtype=src_dt, **kw)
            for (k, v), (wk, wv) in zip(res.layers(), want):
                assert k.dtype == dt and torch.equal(k, wk.to(dt)) and torch.equal(v, wv.to(dt)), dt
        assert res.stats.cached_blocks == 4


@pytest.fixture
def hung_store():
    """A TCP server that accepts every connection and never answers: a hung Redis."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(128)
    srv.settimeout(0.05)
    held, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


def test_a_hung_store_is_skipped_and_streamed_translations_do_not_queue_behind_it(
    sidecar_factory, maps_dir, family, hung_store
):
    """16 concurrent streamed requests against a store that never answers: each is served (the store a miss), the
    store's circuit opens after its first timeouts, so most requests never call it; metrics and the health service
    say so; a key-only request is refused at once while the circuit is open."""
    from concurrent.futures import ThreadPoolExecutor

    from kvferry.client.health import check
    from kvferry.sidecar.server import PREFIX_STORE_SERVICE

    sc = _sidecar(
        sidecar_factory,
        maps_dir,
        redis_url=hung_store,
        prefix_store_timeout_seconds=0.2,
        prefix_store_cooldown_seconds=60,
    )
    assert check(sc.address, PREFIX_STORE_SERVICE) == "SERVING"
    kv, ids = make_kv(layers=4, tokens=32, heads=2, head_dim=32, seed=6), list(range(32))
    with TranslateClient(ClientOptions(target=sc.address, timeout=30, retry=Retry(retries=0))) as c:
        with ThreadPoolExecutor(16) as ex:
            got = list(ex.map(lambda _: c.translate(kv, "S__S-self", token_ids=ids, **_kw(family)), range(16)))
        for res in got:
            torch.testing.assert_close(res.layers()[3][1], kv[3][1])
        assert 1 <= sample(sc, "kvferry_prefix_store_errors_total") < 16  # not one timeout per request
        assert sample(sc, "kvferry_prefix_store_open") == 1
        wait_until(lambda: check(sc.address, PREFIX_STORE_SERVICE) == "NOT_SERVING", what="the store's health")
        with pytest.raises(grpc.RpcError) as e:
            c.translate(None, "S__S-self", token_ids=ids, prefix_key="00" * 32, **_kw(family))
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
        assert check(sc.address) == "SERVING"  # the sidecar itself serves on


def test_a_streamed_request_waits_on_a_hung_store_for_the_probe_alone(sidecar_factory, maps_dir, family, hung_store):
    """The store's timeout is 5 s, its probe's budget 0.05 s: 16 concurrent streamed requests against a store that
    never answers are each served under a 2.5 s deadline (the store a miss), so none waited for the store's timeout;
    the probes still end on that timeout and open the circuit."""
    from concurrent.futures import ThreadPoolExecutor

    sc = _sidecar(
        sidecar_factory,
        maps_dir,
        redis_url=hung_store,
        prefix_store_timeout_seconds=5,
        prefix_probe_seconds=0.05,
        prefix_store_cooldown_seconds=60,
    )
    kv, ids = make_kv(layers=4, tokens=32, heads=2, head_dim=32, seed=6), list(range(32))
    with TranslateClient(ClientOptions(target=sc.address, timeout=2.5, retry=Retry(retries=0))) as c:
        c.translate(kv, "S__S-self", token_ids=ids, **_kw(family))  # warm: the map is loaded and the channel up
        with ThreadPoolExecutor(16) as ex:
            got = list(ex.map(lambda _: c.translate(kv, "S__S-self", token_ids=ids, **_kw(family)), range(16)))
    for res in got:
        torch.testing.assert_close(res.layers()[3][1], kv[3][1])
        assert res.stats.cached_blocks == 0
    wait_until(lambda: sample(sc, "kvferry_prefix_store_open") == 1, timeout=30, what="the probes' timeout")


def test_a_prefix_probe_longer_than_the_store_timeout_is_refused():
    from kvferry.sidecar.config import SidecarConfig

    with pytest.raises(InvalidInput, match=r"prefix_probe_seconds must be in \[0, 0.5\]"):
        SidecarConfig(prefix_store_timeout_seconds=0.5, prefix_probe_seconds=1)


def test_the_circuit_opens_on_a_failure_and_closes_on_the_next_answer():
    now = [0.0]
    changes = []

    from kvferry.common.stores import GuardedStore, StoreUnreachable

    class Flaky:
        fail = True

        def get_many(self, keys):
            if self.fail:
                raise StoreUnreachable("down")
            return [None] * len(keys)

        def put_many(self, items, ttl):
            raise StoreUnavailable("OOM command not allowed")  # it answers: a refusal opens nothing

    inner = Flaky()
    g = GuardedStore(inner, cooldown=10, on_change=changes.append, clock=lambda: now[0])
    with pytest.raises(StoreUnavailable, match="down"):
        g.get_many(["a"])
    assert g.open and changes == [True]
    inner.fail = False
    with pytest.raises(StoreUnavailable, match="circuit is open"):  # skipped, not called
        g.get_many(["a"])
    now[0] = 10.5
    assert g.get_many(["a"]) == [None] and not g.open and changes == [True, False]
    with pytest.raises(StoreUnavailable, match="OOM"):
        g.put_many([("a", b"x")], 60)
    assert not g.open and changes == [True, False]

"""Response regions (kvferry.v1 SharedRegion): the answer's tensor bytes in a file the caller and a real sidecar share,
against the same answer in the messages; what the sidecar refuses, ignores and never leaves behind."""

import os
import secrets

import grpc
import pytest
import torch
from conftest import ROOT, make_kv, sample, wait_until

from kvferry.client.client import (
    TRANSLATE_METHOD,
    ClientOptions,
    Retry,
    SharedMemory,
    TranslateClient,
    encode_requests,
    make_spec,
)
from kvferry.client.importers import PagedKVPool
from kvferry.client.regions import RegionPool, sweep
from kvferry.common import wire
from kvferry.common.messages import Block, BlockBytes
from kvferry.common.prefix_cache import publish_source
from kvferry.common.region_format import region_header
from kvferry.common.stores import RedisStore
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load
from kvferry.mappings.errors import InvalidInput
from kvferry.sidecar.regions import ResponseRegion as SidecarRegion
from kvferry.v1 import translate_pb2 as pb

MAP = ROOT / "maps" / "S__T64" / "1.0.0"  # S (2 heads x 32) -> T64 (a wider target): shapes that cannot be confused


@pytest.fixture(scope="module")
def ms():
    return load(MAP)


@pytest.fixture
def shm(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return d


def _kw(ms):
    return dict(source_geometry=ms.source.geometry.fingerprint, tokenizer=ms.source.tokenizer)


def _kv(ms, tokens, seed=0):
    g = ms.source.geometry
    return make_kv(layers=g.layers, tokens=tokens, heads=g.kv_heads, head_dim=g.head_dim, seed=seed)


def _sidecar(factory, shm=None, **kw):
    return factory(maps_dir=str(ROOT / "maps"), **({"shm_dir": str(shm)} if shm else {}), **kw)


def _settled(sc, timeout=10.0):
    """Wait until the sidecar has no stream in flight (its handler ends just after the caller has the trailer)."""
    wait_until(lambda: sample(sc, "kvferry_active_streams") == 0, timeout, "no stream in flight")


def _open_under(folder) -> list[str]:
    """This process's (the client's and the in-process sidecar's) open descriptors of files in ``folder``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder) + "/"):
            out.append(target)
    return out


def test_an_answer_in_a_region_is_the_answer_in_the_messages(sidecar_factory, shm, ms):
    sc = _sidecar(sidecar_factory, shm)
    kv = _kv(ms, 300, seed=1)
    want = apply(ms, kv, 0)
    with (
        TranslateClient(ClientOptions(target=sc.address, chunk_tokens=128, retry=Retry(retries=0))) as inline,
        TranslateClient(
            ClientOptions(
                target=sc.address, chunk_tokens=128, retry=Retry(retries=0), shared_memory=SharedMemory(dir=str(shm))
            )
        ) as shared,
    ):
        a, b = inline.translate(kv, "S__T64", "1.0.0", **_kw(ms)), shared.translate(kv, "S__T64", "1.0.0", **_kw(ms))
        assert not a.info.response_region and b.info.response_region
        assert a.stats.bytes_out == b.stats.bytes_out  # (where lanes cut a layer into blocks may differ call to call)
        _same(a, b)
        _check(b, want)
        assert all(
            x.key.data_ptr() % 64 == 0 and x.value.data_ptr() % 64 == 0 for x in b.blocks
        )  # aligned, in the mapping
        paged = shared.translate(kv, "S__T64", "1.0.0", layout="paged", block_size=16, **_kw(ms))
        assert paged.info.response_region
        g = ms.target.geometry
        pool = PagedKVPool(g.layers, 19, 16, g.kv_heads, g.head_dim)
        pool.write(paged.blocks, list(range(19)))
        for (k, v), (wk, wv) in zip(pool.gather(list(range(19)), 300), want):
            torch.testing.assert_close(k, wk), torch.testing.assert_close(v, wv)
        assert len(os.listdir(shm)) == 2  # one file each for the two answers still held
        del b, paged, pool
        assert len(os.listdir(shm)) == 2  # freed: both kept for reuse (SharedMemory.idle_files)
    _settled(sc)
    assert os.listdir(shm) == [] and _open_under(shm) == []  # the closed client removed them; nobody holds one open
    assert sample(sc, "kvferry_response_regions_total", outcome="taken") == 2


def test_what_does_not_fit_the_region_comes_in_the_messages(sidecar_factory, shm, ms):
    sc = _sidecar(sidecar_factory, shm)
    kv = _kv(ms, 200, seed=2)
    g = ms.target.geometry
    one = 2 * 200 * g.kv_heads * g.head_dim * 4  # a target layer's K and V, fp32: 64-byte multiples
    want = apply(ms, kv, 0)
    with TranslateClient(
        ClientOptions(
            target=sc.address, retry=Retry(retries=0), shared_memory=SharedMemory(dir=str(shm), region_bytes=one + 164)
        )
    ) as c:
        res = c.translate(kv, "S__T64", "1.0.0", **_kw(ms))
    assert res.info.response_region
    for (k, v), (wk, wv) in zip(res.layers(), want):
        torch.testing.assert_close(k, wk), torch.testing.assert_close(v, wv)
    region = RegionPool(str(shm), one + 164).lease()
    out = _raw_call(sc, kv, ms, (region.name, region.size, region.key), chunk=200)
    placed = [
        (m.block.layer, m.block.key.HasField("region_offset"), m.block.value.HasField("region_offset"))
        for m in out[1:-1]
    ]
    assert placed == [
        (layer, layer == 0, layer == 0) for layer in range(g.layers)
    ]  # layer 0 filled it; the rest inline
    assert (out[1].block.key.region_offset, out[1].block.value.region_offset) == (64, 64 + one // 2)  # after the header
    for m, (wk, wv) in zip(out[1:-1], want):
        block = wire.block_from_pb(m.block, region)
        torch.testing.assert_close(block.key, wk[0]), torch.testing.assert_close(block.value, wv[0])


def test_a_sidecar_without_shm_dir_answers_in_the_messages(sidecar_factory, shm, ms):
    sc = _sidecar(sidecar_factory)
    kv = _kv(ms, 40)
    with TranslateClient(
        ClientOptions(target=sc.address, retry=Retry(retries=0), shared_memory=SharedMemory(dir=str(shm)))
    ) as c:
        res = c.translate(kv, "S__T64", "1.0.0", **_kw(ms))
    assert not res.info.response_region and os.listdir(shm) == []  # the client removed the file nobody took
    for (k, v), (wk, wv) in zip(res.layers(), apply(ms, kv, 0)):
        torch.testing.assert_close(k, wk), torch.testing.assert_close(v, wv)
    assert sample(sc, "kvferry_response_regions_total", outcome="ignored") == 1


def _raw_call(sc, kv, ms, region=None, chunk=64):
    """The response messages of a Translate whose header names ``region`` (name, size[, key]; a random key when none
    is given), parsed by protobuf alone."""
    spec = make_spec(kv, "S__T64", "1.0.0", **_kw(ms))
    reqs = [m.SerializeToString() for m in encode_requests(spec, kv, chunk)]
    if region is not None:
        name, size, key = (*region, secrets.token_bytes(32))[:3]
        head = pb.TranslateRequest.FromString(reqs[0])
        head.header.response_region.name, head.header.response_region.size = name, size
        head.header.response_region.key = key
        reqs[0] = head.SerializeToString()
    with grpc.insecure_channel(sc.address, [("grpc.max_receive_message_length", 64 << 20)]) as ch:
        return [pb.TranslateResponse.FromString(m) for m in ch.stream_stream(TRANSLATE_METHOD)(iter(reqs), timeout=30)]


def test_regions_the_sidecar_refuses_or_ignores(sidecar_factory, shm, ms):
    sc = _sidecar(sidecar_factory, shm)
    kv = _kv(ms, 20)
    for bad in ("../etc/passwd", "kvf-" + "A" * 32, "kvf-" + "0" * 31, "x" * 36, "kvf-" + "0" * 32 + "/x"):
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(sc, kv, ms, (bad, 1 << 20))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "response_region.name" in e.value.details()
    secret = shm / "secret"
    secret.write_bytes(b"untouched")
    for make in ("absent", "symlink", "hardlink", "folder", "fifo"):
        name = "kvf-" + secrets.token_hex(16)
        path = shm / name
        if make == "symlink":
            path.symlink_to(secret)
        elif make == "hardlink":
            os.link(secret, path)
        elif make == "folder":
            path.mkdir()
        elif make == "fifo":
            os.mkfifo(path)
        out = _raw_call(sc, kv, ms, (name, 1 << 20))
        assert not out[0].header.response_region, make
        assert all(m.block.key.data and not m.block.key.HasField("region_offset") for m in out[1:-1]), make
        assert secret.read_bytes() == b"untouched"
        assert make == "absent" or os.path.lexists(path)  # the sidecar never removes a file
    assert sample(sc, "kvferry_response_regions_total", outcome="ignored") == 5
    # a request chunk claiming its bytes lie in a region
    spec = make_spec(kv, "S__T64", "1.0.0", **_kw(ms))
    reqs = list(encode_requests(spec, kv, 64))
    reqs[1].chunk.tensor.ClearField("data")
    reqs[1].chunk.tensor.region_offset = 0
    with grpc.insecure_channel(sc.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(ch.stream_stream(TRANSLATE_METHOD)(iter([r.SerializeToString() for r in reqs]), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "region_offset is for responses" in e.value.details()


def test_a_cancelled_call_leaves_no_file_and_no_descriptor(sidecar_factory, shm, ms):
    import threading

    sc = _sidecar(sidecar_factory, shm)
    kv = _kv(ms, 512)
    release = threading.Event()
    spec = make_spec(kv, "S__T64", "1.0.0", **_kw(ms))
    name, key = _region_file(shm, 64 << 20)
    reqs = [m.SerializeToString() for m in encode_requests(spec, kv, 128)]
    head = pb.TranslateRequest.FromString(reqs[0])
    head.header.response_region.name, head.header.response_region.size = name, 64 << 20
    head.header.response_region.key = key
    reqs[0] = head.SerializeToString()

    def held():
        yield from reqs[:5]  # the first token range: blocks come back, then the stream waits
        release.wait(20)
        yield from reqs[5:]

    with grpc.insecure_channel(sc.address) as ch:
        call = ch.stream_stream(TRANSLATE_METHOD)(held(), timeout=30)
        first = pb.TranslateResponse.FromString(next(call))
        assert first.header.response_region
        call.cancel()
        release.set()
    _settled(sc)
    assert os.listdir(shm) == [name] and _open_under(shm) == []  # the caller's file stays; the sidecar closed it


def test_a_key_only_hit_in_a_region(sidecar_factory, shm, ms, redis_url, family):
    sc = _sidecar(sidecar_factory, shm, redis_url=redis_url, prefix_secret="s", prefix_block_size=16)
    kv = _kv(ms, 70, seed=3)
    ids = list(range(30, 100))
    key = publish_source(
        kv, ids, family["S"].identity, store=RedisStore(redis_url), secret=b"s", tenant="acme", block_size=16
    )
    opts = dict(target=sc.address, retry=Retry(retries=0))
    with (
        TranslateClient(ClientOptions(**opts)) as inline,
        TranslateClient(ClientOptions(**opts, shared_memory=SharedMemory(dir=str(shm)))) as shared,
    ):
        ask = dict(token_ids=ids, tenant="acme", prefix_key=key, **_kw(ms))
        mapped = shared.translate(None, "S__T64", "1.0.0", **ask)  # maps the stored source, writes the target's back
        hit, hit_inline = (
            shared.translate(None, "S__T64", "1.0.0", **ask),
            inline.translate(None, "S__T64", "1.0.0", **ask),
        )
    assert mapped.info.response_region and hit.info.response_region and hit.stats.cached_blocks == 4
    assert all(
        torch.equal(k, ik) and torch.equal(v, iv) and torch.equal(k, mk) and torch.equal(v, mv)
        for (k, v), (mk, mv), (ik, iv) in zip(hit.layers(), mapped.layers(), hit_inline.layers())
    )
    del mapped, hit
    assert os.listdir(shm) == []


class _Sink:
    """A region for the encoder and decoders: each tensor's bytes kept by the aligned offset it was given, from
    ``base``."""

    def __init__(self, base=0):
        self.next, self.at = base, {}

    def put(self, pieces, size):
        off = -(-self.next // 64) * 64
        self.at[off], self.next = b"".join(bytes(p) for p in pieces), off + size
        return off

    def view(self, offset, nbytes):
        if len(self.at.get(offset, b"")) < nbytes:
            raise InvalidInput("past the region")
        return memoryview(self.at[offset])[:nbytes]


@pytest.mark.parametrize("base", [0, 64, 1 << 40])
def test_region_offsets_on_the_wire(base):
    """encode_block_response with a region writes what protobuf writes for region_offset and no data (0 included:
    proto3 optional); both decoders read it back against the region, and refuse it without one."""
    k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    sink = _Sink(base)
    data = wire.encode_block_response(Block(3, 10, 15, 2, k, v), region=sink)
    m = pb.TranslateResponse.FromString(data)
    tensors = [pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 5, 8], region_offset=off) for off in (base, base + 320)]
    assert (
        data
        == pb.TranslateResponse(
            block=pb.TargetBlock(layer=3, token_start=10, token_end=15, block_index=2, key=tensors[0], value=tensors[1])
        ).SerializeToString()
    )
    for block in (wire.decode_response(data, sink), wire.block_from_pb(m.block, sink)):
        assert torch.equal(block.key, k) and torch.equal(block.value, v)
    assert isinstance(wire.decode_response(data), pb.TranslateResponse)  # left to protobuf without a region, then:
    with pytest.raises(InvalidInput, match="has none"):
        wire.block_from_pb(m.block)
    m.block.key.region_offset = base + 1
    with pytest.raises(InvalidInput, match="multiple of 64"):
        wire.decode_response(m.SerializeToString(), sink)


def test_stored_pieces_go_to_the_region_in_one_write(tmp_path):
    """The sidecar's region writes a BlockBytes' pieces back to back (the stored blobs' bytes, no join), skips what
    does not fit, and stops after a failed write."""
    path = tmp_path / "r"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 400)
    key = secrets.token_bytes(32)
    os.pwrite(fd, region_header(key), 0)
    region = SidecarRegion(fd, 400, key)
    pieces = [memoryview(bytes([i]) * 40) for i in range(3)]
    b = BlockBytes(0, 0, 5, 0, torch.float32, (2, 5, 3), pieces[:3], [memoryview(bytes([9]) * 120)])
    m = pb.TranslateResponse.FromString(wire.encode_block_response(b, region=region))
    assert (m.block.key.region_offset, m.block.value.region_offset) == (64, 192)  # the first 64 bytes: the header
    data = path.read_bytes()
    assert data[:64] == region_header(key) and data[64:184] == bytes(40) + bytes([1]) * 40 + bytes([2]) * 40
    assert data[192:312] == bytes([9]) * 120
    again = pb.TranslateResponse.FromString(wire.encode_block_response(b, region=region))
    assert (
        not again.block.key.HasField("region_offset")
        and again.block.key.data == bytes(40) + bytes([1]) * 40 + bytes([2]) * 40
    )
    region.close()
    assert region.put(pieces, 40) is None  # closed: never writes through a descriptor number reused since


def test_a_rekeyed_region_takes_no_more_writes_and_an_idle_file_holds_no_used_key(shm):
    """A call that still holds a file once its owner rekeyed it (a leaked key held across the owner's next call)
    writes nothing more into it; and a file back in its pool is rekeyed at once, so the last call's key opens
    nothing while it is idle."""
    from kvferry.sidecar.regions import RegionFolder

    pool = RegionPool(str(shm), 1 << 16)
    lease = pool.lease()
    name, key = lease.name, lease.key
    taken = RegionFolder(str(shm)).take(name, 1 << 16, key)
    assert taken is not None and taken.put([memoryview(bytes(64))], 64) == 64
    lease.release(True)  # back to the pool, rekeyed: the sidecar's call may write no more
    assert taken.put([memoryview(bytes([7]) * 64)], 64) is None and taken.full
    with open(shm / name, "rb") as fh:
        assert fh.read(64) != region_header(key)
    assert RegionFolder(str(shm)).take(name, 1 << 16, key) is None  # the old key opens nothing
    again = pool.lease()  # the same file, renamed and rekeyed for the next call
    assert again.key != key and RegionFolder(str(shm)).take(again.name, 1 << 16, again.key) is not None
    again.release(True)
    taken.close()
    pool.close()


def test_a_region_that_vanishes_or_cannot_be_made_costs_only_that_calls_zero_copy(sidecar_factory, shm, ms):
    """An idle file unlinked by someone else (another uid may, in a folder without the sticky bit), or a folder where
    no file can be made (full, or gone): that call's answer comes in its messages, nothing is raised and no
    descriptor is left open; the next call uses a region again."""
    import shutil

    sc = _sidecar(sidecar_factory, shm)
    kv = _kv(ms, 100, seed=5)
    want = apply(ms, kv, 0)
    with TranslateClient(
        ClientOptions(target=sc.address, retry=Retry(retries=0), shared_memory=SharedMemory(dir=str(shm)))
    ) as c:
        first = c.translate(kv, "S__T64", "1.0.0", **_kw(ms))
        assert first.info.response_region
        del first  # its file goes back to the pool, idle
        (idle,) = os.listdir(shm)
        os.unlink(shm / idle)  # removed under the live client
        inline = c.translate(kv, "S__T64", "1.0.0", **_kw(ms))
        assert not inline.info.response_region and c.regions.failures == 1
        _check(inline, want)
        del inline
        _settled(sc)
        assert _open_under(shm) == []  # the vanished file's descriptor is closed, not leaked
        again = c.translate(kv, "S__T64", "1.0.0", **_kw(ms))  # a fresh file
        assert again.info.response_region
        _check(again, want)
        del again
        shutil.rmtree(shm)  # no file can be made any more
        gone = c.translate(kv, "S__T64", "1.0.0", **_kw(ms))
        assert not gone.info.response_region and c.regions.failures >= 2
        _check(gone, want)


def test_a_new_file_has_no_region_name_until_it_is_locked(shm, monkeypatch):
    """A sweep only considers region names, and a file gets one only once its creator holds its lock: a sweeping
    client can never remove a file another has just made."""
    import fcntl

    import kvferry.client.regions as regions

    seen = []
    real_flock = fcntl.flock

    def flock(fd, op):  # at the creator's lock: which names does the folder show?
        seen.append(sorted(os.listdir(shm)))
        return real_flock(fd, op)

    monkeypatch.setattr(regions.fcntl, "flock", flock)
    pool = RegionPool(str(shm), 1 << 16)
    lease = pool.lease()
    assert seen and all(not regions.REGION_NAME.fullmatch(n) for names in seen for n in names)
    assert regions.REGION_NAME.fullmatch(lease.name) and sweep(str(shm)) == 0
    lease.release(True)
    pool.close()


def test_a_file_is_reused_once_its_answer_is_freed_and_never_under_a_live_one(sidecar_factory, shm, ms):
    sc = _sidecar(sidecar_factory, shm)
    kvs = [_kv(ms, 100, seed=s) for s in (5, 6, 7)]
    wants = [apply(ms, kv, 0) for kv in kvs]
    with TranslateClient(
        ClientOptions(target=sc.address, retry=Retry(retries=0), shared_memory=SharedMemory(dir=str(shm)))
    ) as c:
        first = c.translate(kvs[0], "S__T64", "1.0.0", **_kw(ms))
        second = c.translate(kvs[1], "S__T64", "1.0.0", **_kw(ms))  # the first answer is alive: another file
        before = _files(shm)
        assert len(before) == 2
        _check(first, wants[0]), _check(second, wants[1])  # neither overwrote the other
        del first, second
        third = c.translate(kvs[2], "S__T64", "1.0.0", **_kw(ms))
        after = _files(shm)
        assert third.info.response_region and set(after.values()) == set(before.values())  # reused, not a third file
        assert len(set(after) - set(before)) == 1  # and renamed before its call
        _check(third, wants[2])
        # a call that fails spoils its file: a sidecar may still be writing into it
        with pytest.raises(grpc.RpcError):
            c.translate(kvs[0], "S__T64", "9.9.9", **_kw(ms))
        del third
        assert len(os.listdir(shm)) == 1  # the failed call spoiled the idle file; the third answer's idles
    assert os.listdir(shm) == []


def _same(a, b):
    """Both answers hold the same tensors (in a function, as _check: a loop variable left over in the test would keep
    a view of b's file alive whenever b's layer came in one block, and the file would outlive the client)."""
    for (k, v), (bk, bv) in zip(a.layers(), b.layers()):
        assert torch.equal(k, bk) and torch.equal(v, bv)


def _check(res, want):
    """The answer is the map's (in a function: no loop variable keeps a view of the answer's file alive)."""
    for (k, v), (wk, wv) in zip(res.layers(), want):
        torch.testing.assert_close(k, wk), torch.testing.assert_close(v, wv)


def _region_file(shm, size: int, key: bytes | None = None) -> tuple[str, bytes]:
    """A caller's region file: a fresh name, ``size`` bytes, its header holding ``key`` (random when None)."""
    name, key = "kvf-" + secrets.token_hex(16), key or secrets.token_bytes(32)
    fd = os.open(shm / name, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    os.pwrite(fd, wire.region_header(key), 0)
    os.close(fd)
    return name, key


def test_naming_another_callers_file_writes_nothing_into_it(sidecar_factory, shm, ms):
    """A caller that can list the folder but not read a file (another uid) knows the name, not the key in the file's
    header: the sidecar does not take the file, and the file's owner's answers stay what the sidecar sent them, the
    one she holds and the next one (her client rekeys the file before every call)."""
    sc = _sidecar(sidecar_factory, shm)
    kv, other = _kv(ms, 300, seed=1), _kv(ms, 300, seed=2)
    with TranslateClient(
        ClientOptions(target=sc.address, retry=Retry(retries=0), shared_memory=SharedMemory(dir=str(shm)))
    ) as alice:
        held = alice.translate(kv, "S__T64", "1.0.0", **_kw(ms))
        assert held.info.response_region
        (name,) = os.listdir(shm)
        before = (shm / name).read_bytes()
        old_key = before[8:40]
        for key in (secrets.token_bytes(32), bytes(32)):  # guessed keys
            out = _raw_call(sc, other, ms, (name, 1 << 30, key))
            assert not out[0].header.response_region
            assert all(m.block.key.data and not m.block.key.HasField("region_offset") for m in out[1:-1])
        assert (shm / name).read_bytes() == before
        _check(held, apply(ms, kv, 0))
        assert sample(sc, "kvferry_response_regions_total", outcome="refused") == 2
        del held
        nxt = alice.translate(kv, "S__T64", "1.0.0", **_kw(ms))  # the same file, renamed and rekeyed
        (renamed,) = os.listdir(shm)
        assert nxt.info.response_region and (shm / renamed).read_bytes()[8:40] != old_key
        out = _raw_call(sc, other, ms, (renamed, 1 << 30, old_key))  # her previous call's key opens nothing now
        assert not out[0].header.response_region
        _check(nxt, apply(ms, kv, 0))
        del nxt


def test_the_file_is_closed_before_the_status_and_never_grown(sidecar_factory, shm, ms):
    sc = _sidecar(sidecar_factory, shm)
    kv = _kv(ms, 200, seed=4)
    name, key = _region_file(shm, 1 << 20)
    out = _raw_call(sc, kv, ms, (name, 1 << 20, key))
    assert out[0].header.response_region and _open_under(shm) == []  # no _settled(): closed before the status
    # a file its caller shrank to the header alone, though the request says 1 MiB: taken, but nothing is written
    # past its end (every tensor inline) and it is not grown
    small, key = _region_file(shm, 64)
    out = _raw_call(sc, kv, ms, (small, 1 << 20, key))
    assert out[0].header.response_region and os.path.getsize(shm / small) == 64
    assert all(m.block.key.data and not m.block.key.HasField("region_offset") for m in out[1:-1])
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(sc, kv, ms, (name, 1 << 20, b"short"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "response_region.key" in e.value.details()


def _files(folder) -> dict[str, int]:
    return {name: os.stat(folder / name).st_ino for name in os.listdir(folder)}


def test_a_new_pool_removes_the_files_of_clients_that_died(shm):
    import subprocess
    import sys

    code = (
        "import sys; from kvferry.client.regions import RegionPool; p = RegionPool(sys.argv[1], 1 << 20); "
        "leases = [p.lease() for _ in range(3)]; print('ready', flush=True); sys.stdin.readline()"
    )
    dead = subprocess.Popen(
        [sys.executable, "-c", code, str(shm)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    alive = subprocess.Popen(
        [sys.executable, "-c", code, str(shm)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert dead.stdout.readline().strip() == "ready" and alive.stdout.readline().strip() == "ready"
    (shm / "unrelated").write_bytes(b"x")
    assert len(os.listdir(shm)) == 7
    dead.kill()
    dead.wait()
    assert RegionPool(str(shm), 1 << 20).swept == 3  # the killed client's; the live one's are locked
    assert len(os.listdir(shm)) == 4 and sweep(str(shm)) == 0
    alive.stdin.write("\n")
    alive.stdin.flush()
    alive.wait()


def test_a_closed_client_leaves_no_file_even_while_its_answer_lives(sidecar_factory, shm, ms):
    sc = _sidecar(sidecar_factory, shm)
    kv = _kv(ms, 100, seed=8)
    c = TranslateClient(
        ClientOptions(target=sc.address, retry=Retry(retries=0), shared_memory=SharedMemory(dir=str(shm)))
    )
    res = c.translate(kv, "S__T64", "1.0.0", **_kw(ms))
    assert res.info.response_region and len(os.listdir(shm)) == 1
    c.close()
    assert os.listdir(shm) == []  # the name is gone at close; the mapping keeps the answer's bytes
    _check(res, apply(ms, kv, 0))
    del res
    assert _open_under(shm) == []


def test_the_shared_folder_is_prepared_for_several_users(tmp_path):
    """`kvferry shm-folder` (the chart's init container): group-writable, sticky and set-group-ID, made if missing,
    the same when made again; a relative path, a file or a link in its place is refused."""
    import stat

    from kvferry.common.region_format import REGION_FOLDER_MODE, prepare_region_folder

    folder = prepare_region_folder(tmp_path / "shm" / "regions")
    assert stat.S_IMODE(os.stat(folder).st_mode) == REGION_FOLDER_MODE == 0o3770
    assert prepare_region_folder(folder) == folder and stat.S_IMODE(os.stat(folder).st_mode) == 0o3770
    (tmp_path / "file").write_text("")
    (tmp_path / "link").symlink_to(folder)
    for bad, words in (
        ("relative/regions", "absolute"),
        (tmp_path / "file", "not a folder"),
        (tmp_path / "link", "link"),
    ):
        with pytest.raises(InvalidInput, match=words):
            prepare_region_folder(bad)


def _as_user(uid: int, work, *args):
    """Run ``work(*args)`` in a forked child as ``uid`` (group 0, the folder's); returns (the child's pid, a pipe
    that yields what ``work`` returned as text, then its end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        code = 0
        try:
            os.close(r)
            os.setgid(0)
            os.setgroups([0])
            os.setuid(uid)
            for line in work(*args):
                os.write(w, f"{line}\n".encode())
        except BaseException as e:
            os.write(w, f"error {e!r}\n".encode())
            code = 1
        os._exit(code)
    os.close(w)
    return pid, os.fdopen(r)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as two other users (needs root to switch)")
def test_a_client_of_another_user_can_neither_remove_nor_sweep_this_ones_regions():
    """Two users share the prepared folder (the pod's group): another user's client cannot unlink this client's
    live region file, and its sweep on start leaves it; this client's sweep passes over the other's dead file
    (not its own to remove), without failing."""
    import shutil
    import tempfile

    from kvferry.common.region_format import prepare_region_folder

    base = tempfile.mkdtemp(prefix="kvf-users-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(base, 0o755)
    folder = str(prepare_region_folder(os.path.join(base, "regions")))
    go_r, go_w = os.pipe()

    def hold():  # a live client: one leased region, held until told to go (or the test ends)
        os.close(go_w)  # so the test's end, closing its own copy, ends the read below
        pool = RegionPool(folder, 1 << 16, mode=0o660)
        yield pool.lease().name
        os.read(go_r, 1)

    def intrude(victim):  # another user's client: its sweep runs at start; then it tries to remove the file
        pool = RegionPool(folder, 1 << 16, mode=0o660)
        assert pool.lease() is not None
        try:
            os.unlink(os.path.join(folder, victim))
            yield "removed"
        except PermissionError:
            yield "refused"  # and it dies holding its file: a dead client's file of another user

    def sweep_as_me():
        yield sweep(folder)

    holder = None
    try:
        holder, said = _as_user(65533, hold)
        live = said.readline().strip()
        assert live.startswith("kvf-"), live
        pid, out = _as_user(65534, intrude, live)
        assert out.read().strip() == "refused" and os.waitpid(pid, 0)[1] == 0
        assert live in os.listdir(folder)
        dead = [n for n in os.listdir(folder) if n != live]
        assert len(dead) == 1 and os.stat(os.path.join(folder, dead[0])).st_uid == 65534
        pid, out = _as_user(65533, sweep_as_me)
        assert out.read().strip() == "0" and os.waitpid(pid, 0)[1] == 0  # not its own: passed over, no failure
        assert sorted(os.listdir(folder)) == sorted([live, *dead])
        os.write(go_w, b"x")
        assert os.waitpid(holder, 0)[1] == 0
        holder = None
    finally:
        os.close(go_w)
        os.close(go_r)
        if holder is not None:
            os.waitpid(holder, 0)  # its read ends with the pipe's last writer gone
        shutil.rmtree(base, ignore_errors=True)

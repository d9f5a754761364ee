"""Windowed maps: a target token's K/V read the source features of that token and the window - 1 before it.

Built from the real cross-model map S -> T (4 -> 6 layers, 2 -> 3 kv heads): its weights are placed at one offset of
a wider window, so the expected output is known exactly from the per-token map (offset 1: token t gets what the
per-token map gives token t - 1; token 0 reads zeros there and gets the bias)."""

import json
import shutil
import subprocess
import sys

import grpc
import pytest
import torch
from conftest import ROOT, make_kv, sample, wait_until

from kvferry.client.client import ClientOptions, Retry, TranslateClient
from kvferry.mappings.apply import StreamingApplier, apply
from kvferry.mappings.artifact import LayerMap, MapSet, load, save
from kvferry.mappings.errors import ArtifactError, InvalidInput
from kvferry.mappings.features import to_features
from kvferry.mappings.geometry import digest

SECRET, BS = "windowed-secret", 16


def windowed(ms: MapSet, window: int, offset: int, version: str = "2.0.0") -> MapSet:
    """``ms`` with every map widened to ``window`` tokens, its weights at ``offset`` and zeros elsewhere."""
    maps = {}
    for key, m in ms.maps.items():
        rows = m.weight.shape[0]
        w = torch.zeros(window * rows, m.weight.shape[1], dtype=m.weight.dtype)
        w[offset * rows : (offset + 1) * rows] = m.weight
        maps[key] = LayerMap(
            m.target_layer, m.kind, m.source_layers, w, m.bias.clone(), m.lam, m.heldout_r2, m.inputs, window
        )
    return MapSet(ms.source, ms.target, maps, version, dict(ms.fit), dict(ms.calibration), ms.evidence)


@pytest.fixture(scope="module")
def per_token():
    return load(ROOT / "maps" / "S__T" / "1.0.0")


@pytest.fixture(scope="module")
def source(per_token):
    g = per_token.source.geometry
    return make_kv(layers=g.layers, tokens=50, heads=g.kv_heads, head_dim=g.head_dim, seed=5)


def _stream(ms, kv, chunk, positions=0, context=0, lanes=None):
    """Push ``kv`` token range by token range (every layer per range); the first ``context`` tokens are context."""
    n = kv[0][0].shape[2]
    app = (
        lanes.applier(ms, positions, None, n - context, context)
        if lanes
        else StreamingApplier(ms, positions, tokens=n - context, context=context)
    )
    out: dict[int, list] = {}
    for s in range(0, n, chunk):
        for layer, (k, v) in enumerate(kv):
            for kind, t in (("k", k), ("v", v)):
                for tl, a, _b, tk, tv in app.push(layer, kind, t[:, :, s : s + chunk], s - context):
                    out.setdefault(tl, []).append((a, tk, tv))
    for tl, a, _b, tk, tv in app.drain():
        out.setdefault(tl, []).append((a, tk, tv))
    assert app.done
    return [
        (
            torch.cat([k for _, k, _ in sorted(out[t], key=lambda x: x[0])], 2),
            torch.cat([v for _, _, v in sorted(out[t], key=lambda x: x[0])], 2),
        )
        for t in sorted(out)
    ]


def test_offset_zero_is_the_per_token_map(per_token, source):
    want = apply(per_token, source)
    for got in (apply(windowed(per_token, 3, 0), source), _stream(windowed(per_token, 3, 0), source, 7)):
        for (k, v), (wk, wv) in zip(got, want):
            torch.testing.assert_close(k, wk, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, wv, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 50])
def test_a_windowed_map_reads_the_tokens_before_across_chunks(per_token, source, chunk):
    tg = per_token.target.geometry
    ref = apply(per_token, source)
    got = _stream(windowed(per_token, 3, 1), source, chunk)
    n = source[0][0].shape[2]
    for t, ((k, v), (rk, rv)) in enumerate(zip(got, ref)):
        assert k.shape == rk.shape == (1, tg.kv_heads, n, tg.head_dim)
        torch.testing.assert_close(v[:, :, 1:], rv[:, :, :-1], rtol=1e-4, atol=1e-4)  # token t from source token t-1
        fk, frk = to_features(k, tg.rope, range(n)), to_features(rk, tg.rope, range(n))  # keys: compare unrotated
        torch.testing.assert_close(fk[:, 1:], frk[:, :-1], rtol=1e-4, atol=1e-4)
        bias = per_token.layer(t, "v").bias
        torch.testing.assert_close(v[0, :, 0], bias.view(tg.kv_heads, tg.head_dim))  # before token 0: zeros in


def test_a_later_start_needs_the_tokens_before_it(per_token, source):
    win = windowed(per_token, 3, 1)
    with pytest.raises(InvalidInput, match="send the 2 before it"):
        StreamingApplier(win, positions=10)
    with pytest.raises(InvalidInput, match="before it"):
        apply(win, source, positions=5)
    # tokens 2.. at positions 2.., with tokens 0 and 1 sent as context: the same as translating all from position 0
    whole = _stream(win, source, 50)
    later = _stream(win, source, 9, positions=2, context=2)
    for (k, v), (wk, wv) in zip(later, whole):
        torch.testing.assert_close(k, wk[:, :, 2:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, wv[:, :, 2:], rtol=1e-4, atol=1e-4)
    StreamingApplier(per_token, positions=10)  # per-token maps need no context


@pytest.mark.parametrize("chunk", [1, 4, 9, 50])
def test_token_lanes_read_the_tokens_before_them(per_token, source, chunk):
    """A translation's tokens mapped in lanes on several threads (sidecar/lanes.py): each lane's window reaches back
    into the lane before it, and into the chunk before; the answer is the whole map's, through a real cross-model
    map, from position 0 and from a later start with its context. Chunks of 4 and 9 tokens are each shared among the
    lanes (in segments of 2 or 3 tokens, each reading the segment before: a chunk reaches the segments after its own);
    chunks of 1 make contiguous lanes, planned only after the context's own chunks arrived."""
    from kvferry.sidecar.lanes import Lanes

    win = windowed(per_token, 3, 1)
    lanes = Lanes(3, min_slice=2, share_min=2)
    whole = _stream(win, source, 50)
    for got in (
        _stream(win, source, chunk, lanes=lanes),
        _stream(win, source, chunk, positions=2, context=2, lanes=lanes),
    ):
        for (k, v), (wk, wv) in zip(got, whole):
            torch.testing.assert_close(k, wk[:, :, -k.shape[2] :], rtol=1e-4, atol=1e-4)  # matmuls of other row counts
            torch.testing.assert_close(v, wv[:, :, -v.shape[2] :], rtol=1e-4, atol=1e-4)


def test_artifact_keeps_the_window_and_says_format_2(per_token, tmp_path):
    dest = save(windowed(per_token, 3, 1), tmp_path)
    man = json.loads((dest / "manifest.json").read_text())
    assert man["format_version"] == 2 and {m.get("window") for m in man["maps"]} == {3}
    back = load(dest)
    assert back.context == 2 and all(m.window == 3 for m in back.maps.values())
    assert json.loads((save(per_token, tmp_path / "plain") / "manifest.json").read_text())["format_version"] == 1
    shown = subprocess.run(
        [sys.executable, "-m", "kvferry", "maps", "inspect", str(dest)], capture_output=True, text=True, check=True
    )
    assert "windowed maps (read the 2 source tokens before each token" in shown.stdout
    # a windowed manifest relabelled as format 1 (checksum recomputed) would be read as per-token maps by older readers
    man["format_version"] = 1
    man.pop("manifest_sha256")
    man["manifest_sha256"] = digest(man)
    (dest / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match="windowed"):
        load(dest)


def test_a_window_the_weights_do_not_match_is_refused(per_token):
    bad = windowed(per_token, 3, 1)
    bad.maps[(0, "k")].window = 2
    with pytest.raises(ArtifactError, match="expected"):
        bad.validate()
    bad.maps[(0, "k")].window = 0
    with pytest.raises(ArtifactError, match="window"):
        bad.validate()


@pytest.fixture
def maps_dir(tmp_path, per_token):
    shutil.copytree(ROOT / "maps" / "S__T" / "1.0.0", tmp_path / "S__T" / "1.0.0")
    save(windowed(per_token, 3, 1), tmp_path)
    return tmp_path


def test_sidecar_maps_past_a_cached_prefix_with_its_context(sidecar_factory, maps_dir, family, per_token, redis_url):
    """A prefix hit covers the first blocks; the mapped rest reads the cached tokens just before it, as context."""

    s = family["S"].identity
    kw = dict(source_geometry=s.geometry.fingerprint, tokenizer=s.tokenizer)
    g = s.geometry
    kv = make_kv(layers=g.layers, tokens=80, heads=g.kv_heads, head_dim=g.head_dim, seed=6)
    ids = list(range(200, 280))
    win = windowed(per_token, 3, 1)
    want = apply(win, kv)
    sc = sidecar_factory(
        maps_dir=str(maps_dir),
        force_maps=True,
        redis_url=redis_url,
        prefix_secret=SECRET,
        prefix_block_size=BS,
        prefix_write_back=True,
    )
    with TranslateClient(ClientOptions(target=sc.address, chunk_tokens=16, retry=Retry(retries=0))) as c:
        first = c.translate([(k[:, :, :48], v[:, :, :48]) for k, v in kv], "S__T", "2.0.0", token_ids=ids[:48], **kw)
        assert first.stats.cached_blocks == 0
        assert {(m.version, m.context_tokens) for m in c.list_mappings("S__T")} == {("1.0.0", 0), ("2.0.0", 2)}
        wait_until(lambda: sample(sc, "kvferry_prefix_writes_total") >= 3, 10, "the first call's write-back")
        longer = c.translate(kv, "S__T", "2.0.0", token_ids=ids, **kw)
        assert longer.stats.cached_blocks == 3
        for (k, v), (wk, wv) in zip(longer.layers(), want):
            torch.testing.assert_close(k, wk, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, wv, rtol=1e-4, atol=1e-4)
        with pytest.raises(grpc.RpcError) as e:
            c.translate([(k[:, :, :8], v[:, :, :8]) for k, v in kv], "S__T", "2.0.0", start_position=40, **kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "before each token" in e.value.details()


def test_key_only_past_stored_target_blocks_reads_their_source_as_context(
    sidecar_factory, maps_dir, family, per_token, redis_url
):
    """Key-only: the first request maps blocks 0-1 and stores them; the longer one finds them and maps blocks 2-3,
    reading the source tokens of block 1 as the window's context."""
    from kvferry.common.prefix_cache import publish_source
    from kvferry.common.stores import RedisStore

    s = family["S"].identity
    kw = dict(source_geometry=s.geometry.fingerprint, tokenizer=s.tokenizer, tenant="acme")
    g = s.geometry
    kv = make_kv(layers=g.layers, tokens=64, heads=g.kv_heads, head_dim=g.head_dim, seed=7)
    ids = list(range(300, 364))
    want = apply(windowed(per_token, 3, 1), kv)
    short = publish_source(
        kv, ids[:32], s, store=RedisStore(redis_url), secret=SECRET.encode(), tenant="acme", block_size=BS
    )
    full = publish_source(kv, ids, s, store=RedisStore(redis_url), secret=SECRET.encode(), tenant="acme", block_size=BS)
    sc = sidecar_factory(
        maps_dir=str(maps_dir), force_maps=True, redis_url=redis_url, prefix_secret=SECRET, prefix_block_size=BS
    )
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        first = c.translate(None, "S__T", "2.0.0", token_ids=ids[:32], prefix_key=short, **kw)
        assert first.info.num_tokens == 32
        longer = c.translate(None, "S__T", "2.0.0", token_ids=ids, prefix_key=full, **kw)
    assert longer.info.num_tokens == 64 and longer.stats.cached_blocks == 2
    for (k, v), (wk, wv) in zip(longer.layers(), want):
        torch.testing.assert_close(k.float(), wk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v.float(), wv, rtol=1e-4, atol=1e-4)

"""Prefix identity and the block format shared by publishers (source servers) and the sidecar.

Identity: chained block hashes over token ids. Block i's hash is
    HMAC-SHA256(secret, namespace || hash(i-1) || token ids of block i)
where the namespace covers the tenant, the model fingerprint and, for mapped blocks, the map
name, version and content digest. Keys therefore reveal nothing about the text, a longer prompt
reuses the blocks of its shared prefix, and one tenant's keys can never equal another's.

Value: one self-describing, checksummed blob per block holding every layer's K and V:
    b"KVFB3\n" + xxh3_64(payload) (8 bytes, little-endian) + payload,  payload = safetensors
    (layer.{i}.k / layer.{i}.v, each [kv_heads, block_size, head_dim], with metadata naming the
    format, tokens and block hash). The checksum catches corruption and truncation (it is not a
    signature: see SECURITY.md); xxh3 runs at ~30 GiB/s here against CRC-32's ~4 and SHA-256's ~2, and
    reads are the hot path. Blobs of format 2 (b"KVFB2\n" + CRC-32) and 1 (b"KVFB1\n" + SHA-256) are
    still read. Tensors are read in place, without copies.
"""

from __future__ import annotations

import array
import functools
import hashlib
import hmac
import json
import re
import struct
import sys
import zlib
from dataclasses import dataclass

import torch
import xxhash
from safetensors.torch import save as st_save

from kvferry.common.errors import InvalidInput, KvferryError
from kvferry.common.tensors import view_bytes

MAGIC = b"KVFB3\n"  # xxh3-64 of the payload (~30 GiB/s; CRC-32 ran ~4 GiB/s and was the hit path's largest cost)
MAGIC_V2 = b"KVFB2\n"  # CRC-32; still read
MAGIC_V1 = b"KVFB1\n"  # SHA-256; still read
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_tenant(tenant: str, what: str = "tenant") -> str:
    """A tenant name (1-64 of letters, digits, '.', '_', '-'), or InvalidInput saying what is wrong."""
    if not _TENANT.fullmatch(tenant or ""):  # fullmatch: '$' alone would accept a trailing newline
        raise InvalidInput(f"{what} {tenant!r} must be 1-64 of letters, digits, '.', '_' or '-'")
    return tenant


LayerKV = tuple[torch.Tensor, torch.Tensor]


class CorruptBlock(KvferryError):
    """A stored block failed its checksum or format checks; treat it as a miss."""


@dataclass(frozen=True)
class Namespace:
    """Whose blocks, of which model, and (for mapped blocks) through which map version."""

    tenant: str
    model: str  # geometry + tokenizer fingerprint of the model whose KV the blocks hold
    map_id: str = ""  # "<name>@<version>#<content sha256>" for mapped (target) blocks; "" for source blocks

    def __post_init__(self) -> None:
        check_tenant(self.tenant)

    def digest(self) -> bytes:
        parts = [b"kvferry-prefix-v1", self.tenant.encode(), self.model.encode(), self.map_id.encode()]
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)

    def key(self, block_hash: bytes) -> str:
        return f"kvf:{self.tenant}:{block_hash.hex()}"


def model_id(identity) -> str:
    """The namespace model id of a ModelIdentity: geometry and tokenizer fingerprints."""
    return model_key(identity.geometry.fingerprint, identity.tokenizer)


def model_key(geometry_fingerprint: str, tokenizer_fingerprint: str) -> str:
    """The namespace model id from the two fingerprints (as ListMappings reports them)."""
    return f"{geometry_fingerprint}:{tokenizer_fingerprint}"


def map_id(name: str, version: str, content_sha256: str) -> str:
    """A mapped block namespace's map id: blocks of another map, version or content never mix."""
    return f"{name}@{version}#{content_sha256}"


DEFAULT_TENANT = "default"


def map_namespaces(tenant: str, source_model: str, target_model: str, mapped: str) -> tuple[Namespace, Namespace]:
    """A map's source-block and mapped-block namespaces for ``tenant`` (DEFAULT_TENANT when empty); the models
    are model_key ids, ``mapped`` a map_id."""
    tenant = tenant or DEFAULT_TENANT
    return Namespace(tenant, source_model), Namespace(tenant, target_model, mapped)


def block_hashes(secret: bytes, ns: Namespace, token_ids, block_size: int) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    if not secret:
        raise InvalidInput("the prefix store needs a non-empty deployment secret")
    if block_size < 1:
        raise InvalidInput("block_size must be >= 1")
    packed = _pack_ids(
        token_ids
    )  # uint32 little-endian, packed once in C (per block struct.pack cost ~1 ms per 8k ids)
    base = ns.digest()
    prev = b"\0" * 32
    out = []
    step = 4 * block_size
    for i in range(len(packed) // step):
        prev = hmac.new(secret, base + prev + packed[i * step : (i + 1) * step], hashlib.sha256).digest()
        out.append(prev)
    return out


def _pack_ids(token_ids) -> bytes:
    """Token ids as uint32 little-endian bytes (what the chain hashes); ids outside uint32 are refused."""
    try:
        ids = array.array(
            "I", token_ids if isinstance(token_ids, (list, tuple, array.array)) else [int(t) for t in token_ids]
        )
    except (OverflowError, TypeError) as e:
        raise InvalidInput(f"token ids must be integers in [0, 2**32): {e}") from None
    if ids.itemsize != 4:  # "I" is 4 bytes on every platform kvferry runs on; refuse rather than hash differently
        raise InvalidInput("this platform's unsigned int is not 32 bits")
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


def encode_block(layers: list[LayerKV], block_hash: bytes, tokens: int) -> bytes:
    """Layers' K/V for one block ([kv_heads, block_size, head_dim] each) -> checksummed blob."""
    tensors = {}
    for i, (k, v) in enumerate(layers):
        tensors[f"layer.{i}.k"] = k.detach().contiguous().cpu()
        tensors[f"layer.{i}.v"] = v.detach().contiguous().cpu()
    meta = {
        "format": "kvferry.block",
        "version": "1",
        "tokens": str(tokens),
        "hash": block_hash.hex(),
        "layers": str(len(layers)),
    }
    payload = st_save(tensors, metadata=meta)
    return MAGIC + xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little") + payload


@dataclass(frozen=True)
class StoredBlock:
    """A verified blob, not yet copied anywhere: per layer, where its K and V bytes lie in ``data`` (each
    [kv_heads, block_size, head_dim] in C order, of ``dtype``)."""

    data: memoryview
    dtype: torch.dtype
    shape: tuple[int, int, int]
    offsets: tuple[tuple[int, int], ...]  # per layer: (K's offset, V's offset)

    def layer(self, i: int) -> LayerKV:
        """Layer i's (K, V): tensors viewing the blob (no copy)."""
        n = self.nbytes
        k, v = self.offsets[i]
        return (
            view_bytes(self.data[k : k + n], self.dtype, self.shape, f"layer {i} K"),
            view_bytes(self.data[v : v + n], self.dtype, self.shape, f"layer {i} V"),
        )

    def layers(self) -> list[LayerKV]:
        """Every layer's (K, V), viewing the blob (no copy). When the tensors tile the payload's first bytes, as
        encode_block writes them, the views come from one view of those bytes split in one call (a third of the
        cost of a view per tensor); else layer by layer."""
        if not self.tiled:
            return [self.layer(i) for i in range(len(self.offsets))]
        tensors = self.tiles().unbind(0)
        return [(tensors[k], tensors[v]) for k, v in self.slots]

    def tiles(self) -> torch.Tensor:
        """A tiled block's tensors as one [2 * layers, *shape] tensor viewing the payload (no copy): layer i's K is
        row ``slots[i][0]``, its V row ``slots[i][1]``."""
        count = 2 * len(self.offsets)
        return view_bytes(self.data[: count * self.nbytes], self.dtype, (count, *self.shape), "block")

    @property
    def slots(self) -> tuple[tuple[int, int], ...]:
        """Per layer, (K's, V's) row in ``tiles()``."""
        n = self.nbytes
        return tuple((k // n, v // n) for k, v in self.offsets)

    @property
    def tiled(self) -> bool:
        """Whether the tensors fill the payload's first 2 * layers * nbytes bytes exactly (in any order), as
        encode_block writes them: then the payload's start is one [2 * layers, *shape] array."""
        size = self.nbytes
        return _tiled(self.offsets, size) and len(self.data) >= 2 * len(self.offsets) * size

    @property
    def nbytes(self) -> int:
        """Bytes of one tensor (one layer's K, or its V)."""
        h, t, d = self.shape
        return h * t * d * _ITEMSIZE[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row (head_dim values) of one head."""
        return self.shape[2] * _ITEMSIZE[self.dtype]


def read_block(blob: bytes, block_hash: bytes, layers: int, shape: tuple[int, int, int]) -> StoredBlock:
    """Verify a blob (checksum, metadata, every tensor's name, dtype, shape and bounds) without copying its
    tensors; raises CorruptBlock on any mismatch."""
    view = memoryview(blob)
    if blob.startswith(MAGIC) and len(blob) >= len(MAGIC) + 8:
        start = len(MAGIC) + 8
        if xxhash.xxh3_64_intdigest(view[start:]) != int.from_bytes(blob[len(MAGIC) : start], "little"):
            raise CorruptBlock("checksum mismatch")
    elif blob.startswith(MAGIC_V2) and len(blob) >= len(MAGIC_V2) + 4:
        start = len(MAGIC_V2) + 4
        if zlib.crc32(view[start:]) != int.from_bytes(blob[len(MAGIC_V2) : start], "little"):
            raise CorruptBlock("checksum mismatch")
    elif blob.startswith(MAGIC_V1) and len(blob) >= len(MAGIC_V1) + 32:
        start = len(MAGIC_V1) + 32
        if hashlib.sha256(view[start:]).digest() != blob[len(MAGIC_V1) : start]:
            raise CorruptBlock("checksum mismatch")
    else:
        raise CorruptBlock("not a kvferry block (bad magic or truncated)")
    try:
        return _read_safetensors(view[start:], block_hash, layers, shape)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptBlock(f"unreadable payload: {e}") from None


def decode_block(
    blob: bytes, block_hash: bytes, layers: int, shape: tuple[int, int, int], dtype: torch.dtype | None = None
) -> list[LayerKV]:
    """Verify and unpack a blob into per-layer (K, V) tensors viewing it (a copy only to change dtype);
    raises CorruptBlock on any mismatch."""
    block = read_block(blob, block_hash, layers, shape)
    out = []
    for i in range(layers):
        k, v = block.layer(i)
        if dtype is not None and k.dtype != dtype:
            k, v = k.to(dtype), v.to(dtype)
        out.append((k, v))
    return out


def _read_safetensors(buf: memoryview, block_hash: bytes, layers: int, shape: tuple[int, int, int]) -> StoredBlock:
    """Where each layer's K and V lie in a safetensors payload; every name, dtype, shape and offset is checked."""
    n = int.from_bytes(buf[:8], "little")
    if not 0 < n <= len(buf) - 8:
        raise ValueError("bad header length")
    raw, data = bytes(buf[8 : 8 + n]), buf[8 + n :]
    template = _header_template(raw, block_hash, layers, shape)
    known = _VERIFIED_HEADERS.get(template) if template else None
    if known is not None and len(data) >= known[2]:
        return StoredBlock(data, known[0], shape, known[1])
    header = json.loads(raw)
    meta = header.pop("__metadata__", {}) or {}
    if meta.get("hash") != block_hash.hex() or meta.get("layers") != str(layers):
        raise CorruptBlock("block metadata does not match the requested hash or layer count")
    pairs, names = _tensor_names(layers)
    if header.keys() != names:
        raise CorruptBlock(f"the block's tensors are not layer.0..{layers - 1}.k/.v")
    dtypes = {info["dtype"] for info in header.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _ST_DTYPES:
        raise CorruptBlock(f"the block's tensors have dtypes {sorted(dtypes)}; expected one of {sorted(_ST_DTYPES)}")
    dtype = _ST_DTYPES[dtypes.pop()]
    size, want, end = shape[0] * shape[1] * shape[2] * _ITEMSIZE[dtype], list(shape), len(data)
    offsets = []
    for pair in pairs:
        at = []
        for name in pair:
            info = header[name]
            lo, hi = info["data_offsets"]
            if (
                info["shape"] != want
                or type(lo) is not int
                or type(hi) is not int
                or hi - lo != size
                or not 0 <= lo <= hi <= end
            ):
                raise CorruptBlock(f"tensor {name}: wrong shape, or offsets [{lo}, {hi}) outside the payload")
            at.append(lo)
        offsets.append(tuple(at))
    if template:
        if len(_VERIFIED_HEADERS) >= _VERIFIED_HEADERS_MAX:
            _VERIFIED_HEADERS.clear()
        _VERIFIED_HEADERS[template] = (dtype, tuple(offsets), max(off for pair in offsets for off in pair) + size)
    return StoredBlock(data, dtype, shape, tuple(offsets))


_HASH_SLOT = b"#" * 64  # stands for the block hash's hex in a header template (hex has no '#')
_VERIFIED_HEADERS: dict[tuple, tuple] = {}  # header template -> (dtype, offsets, payload bytes the offsets need)
_VERIFIED_HEADERS_MAX = 256
"""Headers already verified, with their block hash taken out: the blocks of one map and geometry share one header
but for the hash, so a header equal to a verified one once this block's hash is taken out holds the same names,
dtypes, shapes and offsets, and its metadata names this block (the hash occurs once in each, at the same place).
Skips the JSON parse and the checks (18 of a 6-layer block's 28 us to verify)."""


def _header_template(raw: bytes, block_hash: bytes, layers: int, shape: tuple[int, int, int]) -> tuple | None:
    """``raw`` with ``block_hash``'s hex taken out, with what else it was checked against; None unless the hex occurs
    exactly once (then only the metadata can hold it) and the template marks that one place alone."""
    hexed = block_hash.hex().encode()
    if raw.count(hexed) != 1:
        return None
    template = raw.replace(hexed, _HASH_SLOT)
    return (template, layers, shape) if template.count(_HASH_SLOT) == 1 else None


@functools.lru_cache(maxsize=256)
def _tiled(offsets: tuple[tuple[int, int], ...], size: int) -> bool:
    """Whether tensors of ``size`` bytes at ``offsets`` fill [0, 2 * len(offsets) * size) exactly, in any order."""
    return sorted(off for pair in offsets for off in pair) == list(range(0, 2 * len(offsets) * size, size))


@functools.lru_cache(maxsize=64)
def _tensor_names(layers: int) -> tuple[tuple[tuple[str, str], ...], frozenset]:
    """The tensor names of a block of ``layers`` layers: per layer (K's, V's), and all of them."""
    pairs = tuple((f"layer.{i}.k", f"layer.{i}.v") for i in range(layers))
    return pairs, frozenset(name for pair in pairs for name in pair)


def split_blocks(layers: list[LayerKV], start: int, stop: int, block_size: int) -> list[list[LayerKV]]:
    """Per full block in tokens [start, stop): every layer's (K, V) [kv_heads, block_size, head_dim].

    ``layers`` holds (K, V) as [1, kv_heads, tokens, head_dim] or [kv_heads, tokens, head_dim]."""
    out = []
    for s in range(start, stop - block_size + 1, block_size):
        out.append(
            [
                (
                    (k[0] if k.dim() == 4 else k)[:, s : s + block_size],
                    (v[0] if v.dim() == 4 else v)[:, s : s + block_size],
                )
                for k, v in layers
            ]
        )
    return out

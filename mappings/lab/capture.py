"""Load HF causal LMs, read a calibration corpus, and capture their KV caches."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache import LayerKV
from ..errors import InvalidInput
from ..geometry import ModelIdentity, geometry_of, tokenizer_fingerprint


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    identity: ModelIdentity


def weights_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def load_model(
    path: str | Path, name: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> LoadedModel:
    """Load a local HF model directory (the real transformers code path; no hub access)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").exists():
        raise InvalidInput(
            f"{path} is not an HF model directory (no config.json); pass the folder that holds config.json"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ident = ModelIdentity(
        name or path.name, geometry_of(model.config), tokenizer_fingerprint(tok), weights_digest(path)
    )
    return LoadedModel(model, tok, ident)


def read_corpus(paths: Iterable[str | Path]) -> Iterator[str]:
    """Texts from plain files (one document each) or JSONL files (a "text" field per line)."""
    for p in map(Path, paths):
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        for f in files:
            if not f.is_file():
                continue
            if f.suffix == ".jsonl":
                for line in f.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        yield json.loads(line)["text"]
            else:
                yield f.read_text(encoding="utf-8", errors="replace")


def corpus_digest(paths: Iterable[str | Path]) -> str:
    h = hashlib.sha256()
    for text in read_corpus(paths):
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()


def token_stream(tokenizer, texts: Iterable[str], enough: int | None = None) -> list[int]:
    """Documents as one token stream, EOS between them; stops reading once ``enough`` tokens are in."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
        if enough and len(stream) >= enough:
            break
    return stream


def token_windows(tokenizer, texts: Iterable[str], seq_len: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Concatenate documents (EOS-separated) and cut into windows of ``seq_len`` token ids."""
    stream = token_stream(tokenizer, texts, max_tokens + seq_len if max_tokens else None)
    if max_tokens:
        stream = stream[:max_tokens]
    n = len(stream) // seq_len
    ids = torch.tensor(stream[: n * seq_len], dtype=torch.long)
    return list(ids.view(n, seq_len)) if n else []


@torch.no_grad()
def capture_kv(model, input_ids: torch.Tensor) -> list[LayerKV]:
    """Run a prefill and return every layer's (K, V); keys are post-RoPE as cached.

    Only the decoder runs (``model.base_model``): the LM head, a vocabulary-wide matmul per token (a fifth of a
    0.5B model's prefill), makes nothing the cache holds."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    out = model.base_model(input_ids=input_ids.to(model.device), use_cache=True)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


class _Stop(Exception):
    """Raised by a hook to end a forward after the layers it needs."""


@torch.no_grad()
def capture_first_layers(model, input_ids: torch.Tensor, layers: int) -> list[LayerKV]:
    """The (K, V) of the model's first ``layers`` decoder layers over ``input_ids``, at ``layers / total`` of a
    prefill's work: the forward stops once that layer has run (its cache entry is written when its attention runs)."""
    from transformers import DynamicCache

    blocks = model.base_model.layers
    if not 1 <= layers <= len(blocks):
        raise InvalidInput(f"layers must be in [1, {len(blocks)}], got {layers}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    cache = DynamicCache(config=model.config)

    def stop(*_):
        raise _Stop

    handle = blocks[layers - 1].register_forward_hook(stop)
    try:
        model.base_model(input_ids=input_ids.to(model.device), past_key_values=cache, use_cache=True)
    except _Stop:
        pass
    finally:
        handle.remove()
    return [(layer.keys, layer.values) for layer in cache.layers[:layers]]

import pytest
import torch
from conftest import save_tiny, tiny_config

from kvferry.mappings.errors import Incompatible
from kvferry.mappings.geometry import ModelIdentity, check_pair, geometry_of
from kvferry.mappings.lab.capture import load_model
from kvferry.mappings.rope import cos_sin, rotate, unrotate


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_geometry_per_architecture(tiny_models, arch):
    m = load_model(tiny_models[arch])
    g = m.identity.geometry
    assert (g.architecture, g.layers, g.kv_heads, g.head_dim) == (arch, 2, 2, 16)
    assert g.rope.rope_type == "default" and g.rope.theta == 10000.0
    assert ("qk_norm" in g.attention) == (arch == "qwen3")
    assert len(g.fingerprint) == 64 and g.fingerprint == geometry_of(m.model.config).fingerprint


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_rope_matches_model_rotary_embedding(tiny_models, arch):
    m = load_model(tiny_models[arch])
    pos = torch.arange(0, 700, 7)[None]
    cos_ref, sin_ref = m.model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), position_ids=pos)
    cos, sin = cos_sin(m.identity.geometry.rope, pos)
    torch.testing.assert_close(cos, cos_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, sin_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    ],
)
def test_scaled_rope_matches_and_inverts(tmp_path, rope):
    m = load_model(save_tiny(tmp_path / "m", tiny_config("llama", **rope)))
    spec = m.identity.geometry.rope
    assert spec.rope_type == rope["rope_type"]
    pos = torch.arange(0, 5000, 50)[None]
    cos_ref, _sin_ref = m.model.model.rotary_emb(torch.zeros(1), position_ids=pos)
    cos, _sin = cos_sin(spec, pos)
    torch.testing.assert_close(cos, cos_ref, rtol=1e-5, atol=1e-5)
    k = torch.randn(1, 2, pos.shape[1], 16)
    torch.testing.assert_close(unrotate(rotate(k, spec, pos[0]), spec, pos[0]), k, rtol=1e-4, atol=1e-4)


def test_cached_keys_are_post_rope_and_unrotate_to_k_proj(tiny_models):
    """The cache holds rotated keys; un-rotating recovers k_proj(x) exactly (llama: no k-norm)."""
    m = load_model(tiny_models["llama"])
    ids = torch.randint(2, 4096, (1, 20))
    captured = {}
    attn = m.model.model.layers[0].self_attn
    h = attn.k_proj.register_forward_hook(lambda mod, args, out: captured.setdefault("k", out))
    out = m.model(input_ids=ids, use_cache=True)
    h.remove()
    k_cache = out.past_key_values.layers[0].keys  # [1, 2, 20, 16]
    k_proj = captured["k"].view(1, 20, 2, 16).transpose(1, 2)
    spec = m.identity.geometry.rope
    torch.testing.assert_close(unrotate(k_cache, spec, torch.arange(20)), k_proj, rtol=1e-5, atol=1e-5)


def test_unsupported_rope_is_refused(tmp_path):
    cfg = tiny_config("llama", rope_type="dynamic", factor=2.0)
    with pytest.raises(Incompatible, match="depends on the sequence length"):
        geometry_of(cfg)


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config

    with pytest.raises(Incompatible, match="not supported; supported: llama"):
        geometry_of(GPT2Config())


def test_tokenizer_mismatch_is_refused(tiny_models, tmp_path):
    import json
    import shutil

    a = load_model(tiny_models["llama"])
    other = tmp_path / "other"
    shutil.copytree(tiny_models["llama"], other)
    spec = json.loads((other / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = merges[:-1]  # one merge fewer: a different tokenizer
    (other / "tokenizer.json").write_text(json.dumps(spec))
    b = load_model(other)
    assert a.identity.tokenizer != b.identity.tokenizer
    with pytest.raises(Incompatible, match="tokenizers differ"):
        check_pair(a.identity, b.identity)
    check_pair(a.identity, load_model(tiny_models["qwen3"]).identity)  # same tokenizer: accepted


def test_identity_roundtrip_and_edited_fingerprint(tiny_models):
    ident = load_model(tiny_models["qwen2"]).identity
    d = ident.as_dict()
    assert ModelIdentity.from_dict(d) == ident
    d["geometry"]["layers"] = 3
    with pytest.raises(Incompatible, match="manifest was edited"):
        ModelIdentity.from_dict(d)


def test_same_files_loaded_by_another_tokenizer_class_are_refused(tiny_models):
    """transformers loads these tokenizer files as Qwen2Tokenizer for a qwen2 model, which swaps the
    pre-tokenizer: the token ids really differ, and the fingerprint catches it."""
    llama, qwen2 = load_model(tiny_models["llama"]), load_model(tiny_models["qwen2"])
    text = "def f(x):\n  return 1"
    assert llama.tokenizer(text)["input_ids"] != qwen2.tokenizer(text)["input_ids"]
    with pytest.raises(Incompatible, match="tokenizers differ"):
        check_pair(llama.identity, qwen2.identity)


def test_a_different_chat_template_is_not_a_different_tokenizer(tiny_models, tmp_path):
    """Two sizes of one family share token ids but not always their chat template (Qwen2.5-Coder 0.5B and 1.5B):
    the template formats text, it does not tokenize it, so the pair is accepted; a changed vocabulary is not."""
    import json
    import shutil

    a = load_model(tiny_models["llama"])
    chat = tmp_path / "chat"
    shutil.copytree(tiny_models["llama"], chat)
    (chat / "chat_template.jinja").write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
    b = load_model(chat)
    assert b.tokenizer.chat_template and b.tokenizer.chat_template != a.tokenizer.chat_template
    check_pair(a.identity, b.identity)
    vocab = tmp_path / "vocab"
    shutil.copytree(chat, vocab)
    spec = json.loads((vocab / "tokenizer.json").read_text())
    token, _idx = next(iter(spec["model"]["vocab"].items()))
    spec["model"]["vocab"][token + "x"] = spec["model"]["vocab"].pop(token)  # one token's text changed
    (vocab / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(Incompatible, match="tokenizers differ"):
        check_pair(b.identity, load_model(vocab).identity)

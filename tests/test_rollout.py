"""Rollout controls against a real sidecar and the shipped models: the policy, the drift signal, shadow
checks, the automatic switch-off of a degraded map, and the kill switch under load."""

import os
import threading

import pytest
import torch
from conftest import DATA, PASSING_COPY, wait_until

from kvferry.client.cascade import Cascade
from kvferry.client.client import ClientOptions, Retry, TranslateClient
from kvferry.client.rollout import MapRollout, PolicyStore, RolloutPolicy, Unresolved, draw
from kvferry.mappings.artifact import save, write_evidence
from kvferry.mappings.drift import QueryTap
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.geometry import geometry_of
from kvferry.mappings.lab.capture import capture_kv, load_model, read_corpus, token_windows
from kvferry.mappings.lab.fit import identity_mapset

EVIDENCE = {
    "arms": {
        "mapped_refresh": {
            "top1": 1.0,
            "top10": 1.0,
            "kl": 0.0,
            "attn_cos": 1.0,
            "drift_attn_cos": 1.0,
            "drift_rel_err": 0.0,
        }
    },
    "recommended_refresh": 8,
    "copy": PASSING_COPY,
}


@pytest.fixture(scope="module")
def maps_dir(tmp_path_factory, family):
    """S -> S: an exact map 1.0.0, and 2.0.0 = the same with noise in its weights, carrying the same (good)
    offline evidence: the kind of map only live monitoring can catch."""
    root = tmp_path_factory.mktemp("maps")
    ident = family["S"].identity
    write_evidence(save(identity_mapset(ident, version="1.0.0"), root), EVIDENCE)
    bad = identity_mapset(ident, version="2.0.0")
    g = torch.Generator().manual_seed(0)
    for m in bad.maps.values():
        m.weight = m.weight + 0.25 * torch.randn(m.weight.shape, generator=g)
    write_evidence(save(bad, root), EVIDENCE)
    return root


@pytest.fixture(scope="module")
def prompts(family):
    tok = family["S"].tokenizer
    return [w[None] for w in token_windows(tok, list(read_corpus([DATA / "heldout.jsonl"])), 96)[:12]]


def _policy_file(path, **entry) -> None:
    body = "\n".join(
        f"{k} = {v!r}".replace("'", '"').replace("True", "true").replace("False", "false") for k, v in entry.items()
    )
    path.write_text(f"[maps.S__S-self]\n{body}\n")
    _stamp[0] = max(_stamp[0] + 1, path.stat().st_mtime_ns)  # a new mtime for every write, however fast they come
    os.utime(path, ns=(_stamp[0], _stamp[0]))


_stamp = [0]


def test_policy_file_parsing_and_validation(tmp_path):
    p = RolloutPolicy.from_toml(
        '[default]\nrefresh = 8\nmin_tokens = 32\n[maps.a__b]\ncanary_percent = 10\nversion = "1.2.0"\n'
    )
    assert p.get("a__b") == MapRollout(refresh=8, min_tokens=32, canary_percent=10, version="1.2.0")
    assert p.get("other").refresh == 8 and p.get("other").canary_percent == 100
    for text, needle in (
        ("[maps.x]\ncanary = 5\n", "unknown keys"),
        ("[maps.x]\ncanary_percent = 150\n", "0-100"),
        ('[maps.x]\nversion = "../1"\n', "semantic version"),
        ("[mapz.x]\n", "unknown sections"),
        ("[maps.x\n", "TOML"),
    ):
        with pytest.raises(InvalidInput, match=needle):
            RolloutPolicy.from_toml(text)


def test_store_reloads_pins_latest_once_per_rollout_and_clears_auto_off(tmp_path):
    f = tmp_path / "policy.toml"
    _policy_file(f, enabled=True, refresh=8, min_tokens=32)
    store = PolicyStore(path=f, reload_seconds=0)
    calls = []

    def resolve():
        calls.append(1)
        return f"1.{len(calls)}.0"

    assert store.pinned_version("S__S-self", resolve) == "1.1.0"
    assert store.pinned_version("S__S-self", resolve) == "1.1.0" and len(calls) == 1  # pinned, not re-resolved
    store.disable("S__S-self", "drift")
    assert store.off_reason("S__S-self").startswith("auto_disabled: drift")
    _policy_file(f, enabled=True, refresh=8, min_tokens=32, canary_percent=50.0)  # a new rollout
    assert store.off_reason("S__S-self") == ""
    assert store.pinned_version("S__S-self", resolve) == "1.2.0"
    _policy_file(f, enabled=False, refresh=8, min_tokens=32)
    assert store.off_reason("S__S-self").startswith("disabled: kill switch")
    f.write_text("[maps.S__S-self]\nrefresh = -1\n")  # a broken edit keeps the last good policy
    assert store.get("S__S-self").enabled is False and store.get("S__S-self").refresh == 8


def test_one_plan_decides_every_request(tmp_path):
    """PolicyStore.plan: the switches, then min_tokens, then the canary draw, then the version ("latest" resolved once
    per policy generation), then the refresh (raised to the evidence's) and a prompt longer than it; the canary and
    shadow draws are stable, independent functions of the request id."""
    f = tmp_path / "policy.toml"
    _policy_file(f, refresh=8, min_tokens=32, canary_percent=50.0, shadow_percent=30.0)
    store = PolicyStore(path=f, reload_seconds=0)
    calls = []

    def resolve():
        calls.append(1)
        return "1.0.0"

    def plan(request_id, n=100, measured=12):
        return store.plan("S__S-self", request_id, n, resolve, lambda v: measured)

    ids = [f"req-{i}" for i in range(400)]
    plans = [plan(i) for i in ids]
    assert [p.mapped for p in plans] == [draw(i, "canary") < 50 for i in ids]
    assert 150 < sum(p.mapped for p in plans) < 250 and calls == [1]  # "latest" resolved once
    mapped = [p for p in plans if p.mapped]
    assert all(
        p.version == "1.0.0" and p.refresh == 12 and p.reason == "mapped S__S-self 1.0.0, refresh r=12" for p in mapped
    )
    assert 0.15 < sum(p.shadow for p in mapped) / len(mapped) < 0.45  # its own draw, not the canary's
    assert all(p.reason == "canary_holdout: outside the 50% canary" for p in plans if not p.mapped)
    assert [p.mapped for p in (plan(i) for i in ids)] == [p.mapped for p in plans]  # stable
    inside = next(i for i in ids if draw(i, "canary") < 50)
    assert plan(inside, n=31).reason == "short_prompt: 31 < min_tokens 32"
    assert plan(inside, n=40, measured=40).reason == "short_prompt: 40 tokens <= refresh r=40"
    assert plan(inside, measured=0).refresh == 8  # no evidence: the policy's own refresh

    def unresolved():
        raise Unresolved("map_not_found: nothing")

    _policy_file(f, refresh=8, min_tokens=32, canary_percent=100.0)  # a new generation: resolved again
    assert store.plan("S__S-self", inside, 100, unresolved, lambda v: 0).reason == "map_not_found: nothing"
    assert plan(inside).mapped and calls == [1, 1]
    store.disable("S__S-self", "drift")
    assert plan(inside).reason.startswith("auto_disabled: drift")
    _policy_file(f, refresh=8, min_tokens=32, enabled=False)
    assert plan(inside).reason.startswith("disabled: kill switch") and not plan(inside).mapped


def test_the_cascade_and_the_vllm_connector_decide_alike(sidecar_factory, maps_dir, family, prompts, tmp_path):
    """The same requests under the same policy file: the cascade (HF) and the vLLM connector's scheduler side each
    ask the sidecar for "latest" and the evidence's refresh themselves, and take the same decision for every
    request; the cascade's path follows it."""
    from types import SimpleNamespace

    from kvferry.client.connector_config import ConnectorConfig
    from kvferry.client.vllm_scheduler import ConnectorScheduler

    s = family["S"]
    sc = sidecar_factory(maps_dir=str(maps_dir))
    f = tmp_path / "policy.toml"
    _policy_file(f, refresh=4, min_tokens=32, canary_percent=50.0, shadow_percent=25.0)
    cfg = ConnectorConfig(
        sidecar=sc.address,
        map_name="S__S-self",
        redis_url="redis://127.0.0.1:1/0",
        prefix_secret="x" * 32,
        policy_file=str(f),
        policy_reload_seconds=0,
    )
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        connector = ConnectorScheduler(cfg, 16, True, False, lambda: c, lambda: None)
        cascade = Cascade(s.model, c, "S__S-self", PolicyStore(path=f, reload_seconds=0), s.identity)
        ids = prompts[0][:, :80]
        requests = [SimpleNamespace(request_id=f"r{i}", prompt_token_ids=ids[0].tolist()) for i in range(24)]
        short = [SimpleNamespace(request_id=f"s{i}", prompt_token_ids=ids[0, :20].tolist()) for i in range(4)]
        for req in requests + short:
            n = len(req.prompt_token_ids)
            mine = cascade.store.plan("S__S-self", req.request_id, n, cascade._latest, cascade.measured_refresh)
            assert connector.plan(req) == mine, req.request_id
        plans = [connector.plan(r) for r in requests]
        assert {p.mapped for p in plans} == {True, False}
        assert {(p.version, p.refresh) for p in plans if p.mapped} == {("2.0.0", 8)}  # latest; the evidence's r = 8
        kv = capture_kv(s.model, ids)
        for req, p in list(zip(requests, plans))[:6]:
            res = cascade.generate(ids, kv, 1, request_id=req.request_id)
            assert res.path == ("mapped" if p.mapped else "fallback") and (p.mapped or res.reason == p.reason)
        cascade.close()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_query_tap_sees_the_queries_the_attention_used(tiny_models, arch):
    """Attention recomputed from tapped queries and the cached K/V equals the model's own (the input of o_proj)."""
    m = load_model(tiny_models[arch])
    ids = torch.randint(2, 4096, (1, 12))
    seen = []
    hooks = [
        l.self_attn.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0].detach()))
        for l in m.model.model.layers
    ]
    tap = QueryTap(m.model, geometry_of(m.model.config).rope)
    with torch.no_grad():
        out = m.model(input_ids=ids, use_cache=True)
    tap.close()
    for h in hooks:
        h.remove()
    from kvferry.mappings.drift import _attend

    for layer, (q, (k, v)) in enumerate(
        zip(tap.queries(range(12)), [(l.keys, l.values) for l in out.past_key_values.layers])
    ):
        mine = _attend(q, k[0].float(), v[0].float())  # [H, T, d]
        torch.testing.assert_close(mine.transpose(0, 1).reshape(12, -1), seen[layer].float(), rtol=1e-4, atol=1e-4)


def _run(cascade, family, prompts, count):
    s = family["S"]
    out = []
    for ids in prompts[:count]:
        res = cascade.generate(ids, capture_kv(s.model, ids), max_new_tokens=4)
        if res.shadow is not None:
            res.shadow.result(60)
        out.append(res)
    return out


@pytest.mark.parametrize("signal", ["drift_attn_cos", "shadow"])
def test_a_degraded_map_is_caught_live_and_switched_off(sidecar_factory, maps_dir, family, prompts, tmp_path, signal):
    s = family["S"]
    sc = sidecar_factory(maps_dir=str(maps_dir))  # gates on: both versions carry passing evidence
    f = tmp_path / "policy.toml"
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        _policy_file(f, version="1.0.0", refresh=8, min_tokens=32, shadow_percent=100.0, window=4, min_samples=3)
        good = Cascade(s.model, c, "S__S-self", PolicyStore(path=f, reload_seconds=0), s.identity)
        ok = _run(good, family, prompts, 4)
        assert all(r.path == "mapped" for r in ok)
        assert all(r.drift.mean_attn_cos > 0.9999 and r.drift.mean_rel_err < 1e-4 for r in ok)  # exact map: no drift
        assert all(r.shadow.result()[1] == 1.0 for r in ok)

        only_shadow = (
            {"min_drift_attn_cos": -1.0, "max_drift_rel_err": 1e9} if signal == "shadow" else {}
        )  # let the shadow checks do it
        _policy_file(
            f, version="2.0.0", refresh=8, min_tokens=32, shadow_percent=100.0, window=4, min_samples=3, **only_shadow
        )
        store = PolicyStore(path=f, reload_seconds=0)
        bad = Cascade(s.model, c, "S__S-self", store, s.identity)
        runs = _run(bad, family, prompts, 8)
        mapped = [r for r in runs if r.path == "mapped"]
        assert mapped and mapped[0].translate.info.map_version == "2.0.0"
        assert all(
            r.drift.mean_attn_cos < 0.99 and r.drift.mean_rel_err > 0.05 for r in mapped
        )  # the drift signal rises
        shadows = [r.shadow.result() for r in mapped]
        top10, kl = sum(x[1] for x in shadows) / len(shadows), sum(x[2] for x in shadows) / len(shadows)
        assert (
            top10 < 0.9 or kl > 0.02
        )  # shadow agreement falls below the gate (evidence top-10 1.0 - 0.1; KL 3 x 0 + 0.02)
        assert len(mapped) <= 4  # switched off within the window
        assert store.off_reason("S__S-self").startswith(f"auto_disabled: {signal}")
        later = runs[len(mapped) :]
        assert later and all(r.path == "fallback" and r.reason.startswith("auto_disabled") for r in later)
        for r, ids in zip(later, prompts[len(mapped) :]):  # and the fallback answers are the target's own
            assert r.tokens == bad.full_prefill(ids, 4).tokens
        assert store.off_reason("S__S-self").startswith("auto_disabled")
        store.reenable("S__S-self")
        assert store.off_reason("S__S-self") == ""


def test_canary_share_and_kill_switch_under_load(sidecar_factory, maps_dir, family, prompts, tmp_path):
    s = family["S"]
    sc = sidecar_factory(maps_dir=str(maps_dir))
    f = tmp_path / "policy.toml"
    _policy_file(f, version="1.0.0", refresh=8, min_tokens=32, canary_percent=50.0)
    store = PolicyStore(path=f, reload_seconds=0)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        cascade = Cascade(s.model, c, "S__S-self", store, s.identity)
        kv = capture_kv(s.model, prompts[0])
        paths = [cascade.generate(prompts[0], kv, 1, request_id=f"req-{i}").path for i in range(40)]
        assert 10 <= paths.count("mapped") <= 30  # about half (the draws of these 40 ids are fixed)
        again = [cascade.generate(prompts[0], kv, 1, request_id=f"req-{i}").path for i in range(40)]
        assert again == paths  # a stable function of the request id
        _policy_file(f, version="1.0.0", refresh=8, min_tokens=32)  # full rollout
        gold = cascade.full_prefill(prompts[0], 6).tokens
        results, errors, flipped = [], [], threading.Event()

        def worker():
            local = Cascade(s.model, c, "S__S-self", store, s.identity)
            while len(results) < 60:
                try:
                    results.append((flipped.is_set(), local.generate(prompts[0], kv, max_new_tokens=6)))
                except Exception as e:
                    errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: len(results) >= 15, 30, "15 requests under the first policy")
        _policy_file(f, version="1.0.0", refresh=8, min_tokens=32, enabled=False)  # the kill switch, under load
        flipped.set()
        for t in threads:
            t.join(120)
    assert not errors
    assert all(r.tokens == gold for _, r in results)  # nothing dropped or wrong, whichever path
    before = [r for was_flipped, r in results if not was_flipped]
    after = [r for was_flipped, r in results if was_flipped]
    assert any(r.path == "mapped" for r in before)
    assert after[-10:] and all(r.path == "fallback" and r.reason.startswith("disabled") for r in after[-10:])


def test_rollback_is_one_command_and_the_file_round_trips(tmp_path):
    import subprocess
    import sys

    f = tmp_path / "policy.toml"

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "kvferry", "rollout", str(f), "S__T", *args], capture_output=True, text=True
        )

    assert run("--version", "1.1.0", "--canary", "10", "--shadow", "5").returncode == 0
    store = PolicyStore(path=f, reload_seconds=0)
    assert store.get("S__T") == MapRollout(version="1.1.0", canary_percent=10, shadow_percent=5)
    assert run("--version", "1.0.0").returncode == 0  # the rollback
    assert store.get("S__T").version == "1.0.0" and store.get("S__T").canary_percent == 10
    bad = run("--canary", "150")
    assert bad.returncode != 0 and "0-100" in bad.stderr
    assert run("--disable").returncode == 0 and store.off_reason("S__T").startswith("disabled")


def test_a_map_for_another_target_model_is_never_used(sidecar_factory, maps_dir, family, prompts):
    """The S->S map offered to T: the response names S as the target geometry, so the cascade refuses it."""
    t = family["T"]
    sc = sidecar_factory(maps_dir=str(maps_dir))
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        cascade = Cascade(
            t.model, c, "S__S-self", MapRollout(version="1.0.0", refresh=8, min_tokens=32), family["S"].identity
        )
        res = cascade.generate(prompts[0], capture_kv(family["S"].model, prompts[0]), max_new_tokens=2)
    assert res.path == "fallback" and res.reason.startswith("map_incompatible")


def test_the_refresh_never_falls_below_the_one_the_evidence_measured(sidecar_factory, maps_dir, family, prompts):
    """The maps' evidence was measured with r = 8: a rollout asking for r = 4 still gets 8, so a source cache that
    stops 6 tokens short of the prompt is enough (with r = 4 it would not be), and a prompt of 8 tokens or fewer
    takes the target's own prefill."""
    s = family["S"]
    sc = sidecar_factory(maps_dir=str(maps_dir))
    ids = prompts[0][:, :80]
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        cascade = Cascade(s.model, c, "S__S-self", MapRollout(refresh=4, min_tokens=5, version="1.0.0"), s.identity)
        res = cascade.generate(ids, capture_kv(s.model, ids[:, :74]), max_new_tokens=4)
        assert res.path == "mapped" and res.reason.endswith("refresh r=8"), res.reason
        assert res.tokens == cascade.full_prefill(ids, 4).tokens
        short = cascade.generate(ids[:, :8], capture_kv(s.model, ids[:, :8]), max_new_tokens=2)
        assert short.path == "fallback" and short.reason.startswith("short_prompt: 8 tokens <= refresh r=8")
        unmeasured = Cascade(
            s.model, c, "S__S-self", MapRollout(refresh=16, min_tokens=17, version="1.0.0"), s.identity
        )
        assert unmeasured.generate(ids, capture_kv(s.model, ids), max_new_tokens=2).reason.endswith("refresh r=16")


def test_set_policy_replaces_the_policy_in_process():
    store = PolicyStore(RolloutPolicy(maps={"S__T": MapRollout(version="1.0.0")}))
    assert store.get("S__T").version == "1.0.0"
    store.set_policy(RolloutPolicy(maps={"S__T": MapRollout(version="1.1.0", canary_percent=25)}))
    assert store.get("S__T").version == "1.1.0" and store.get("S__T").canary_percent == 25


def test_kv_only_samples_gate_on_the_relative_error_for_drift_and_shadow():
    """vLLM's connector sees no queries: its drift and shadow samples are K/V errors alone (``kv_drift``), gated on
    ``max_drift_rel_err`` (from the evidence: 1.25 x its drift error + 0.05), the attention cosine left unchecked."""
    from types import SimpleNamespace

    from kvferry.client.monitor import QualityMonitor, Thresholds
    from kvferry.mappings.drift import kv_drift

    true = [(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8))] * 3
    close = kv_drift([(k * 1.1, v * 1.1) for k, v in true], true)
    far = kv_drift([(k * 1.4, v * 0.6) for k, v in true], true)
    assert close.mean_attn_cos is None and close.tokens == 4
    assert close.mean_rel_err == pytest.approx(0.1) and far.mean_rel_err == pytest.approx(0.4)
    evidence = SimpleNamespace(drift_attn_cos=0.95, drift_rel_err=0.2, top10=0.9, kl=0.1)
    for signal in ("drift", "shadow"):
        store = PolicyStore.static("m", MapRollout(window=2, min_samples=2))
        th = Thresholds.resolve(store.get("m"), evidence)
        assert th.max_drift_rel_err == pytest.approx(0.3)
        monitor = QualityMonitor(store)
        assert monitor.observe_drift("m", "1.0.0", close, th, signal) == ""
        assert monitor.observe_drift("m", "1.0.0", close, th, signal) == ""  # a full window under the gate
        assert monitor.observe_drift("m", "1.0.0", far, th, signal) == ""  # window mean 0.25
        reason = monitor.observe_drift("m", "1.0.0", far, th, signal)
        assert reason.startswith(f"{signal}_rel_err mean 0.4000") and store.off_reason("m").startswith("auto_disabled")
    assert Thresholds.resolve(MapRollout(max_drift_rel_err=0.7), evidence).max_drift_rel_err == 0.7


def test_the_connector_schedules_drift_and_shadow_checks_and_feeds_the_monitor(
    sidecar_factory, maps_dir, redis_url, tmp_path
):
    """The vLLM connector's scheduler side (no vLLM needed): a mapped request whose refreshed tail holds a whole
    published prefix block loads the blocks before it and has that block translated too; the block is compared in
    the step that computes it. A shadow-sampled request loads nothing and has its published prefix compared once
    the engine has prefilled it. The workers' samples go into the monitor, which switches the map off."""
    from types import SimpleNamespace

    from kvferry.client.connector_config import ConnectorConfig
    from kvferry.client.vllm_scheduler import ConnectorScheduler
    from kvferry.client.vllm_steps import Sample
    from kvferry.common.prefix import Namespace, block_hashes, model_key
    from kvferry.common.stores import RedisStore
    from kvferry.mappings.drift import kv_drift

    sc = sidecar_factory(maps_dir=str(maps_dir))
    f = tmp_path / "policy.toml"
    entry = {
        "version": "1.0.0",
        "refresh": 20,
        "min_tokens": 32,
        "window": 1,
        "min_samples": 1,
        "max_drift_rel_err": 0.5,
    }
    _policy_file(f, **entry)
    bs, prompt = 16, list(range(1000, 1080))  # 80 tokens: 3 blocks before the refreshed 20, a 4th inside them
    cfg = ConnectorConfig(
        sidecar=sc.address,
        map_name="S__S-self",
        redis_url=redis_url,
        prefix_secret="x" * 32,
        prefix_block_size=bs,
        policy_file=str(f),
        policy_reload_seconds=0,
        status_seconds=0,
    )
    store = RedisStore(redis_url)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        sched = ConnectorScheduler(cfg, bs, True, False, lambda: c, lambda: store)
        source = sched.servable("1.0.0").source
        ns = Namespace(cfg.tenant, model_key(source.geometry, source.tokenizer))
        hashes = block_hashes(cfg.secret(), ns, prompt[:64], bs)
        store.put_many([(ns.key(h), b"published") for h in hashes], 60)  # the producer published 4 blocks

        def request(rid):
            return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, num_computed_tokens=0)

        def step(new=()):
            return SimpleNamespace(
                scheduled_new_reqs=[
                    SimpleNamespace(
                        req_id=r, prompt_token_ids=prompt, block_ids=([7, 3, 9, 1, 4],), num_computed_tokens=n
                    )
                    for r, n in new
                ],
                num_scheduled_tokens={r: 80 - n for r, n in new},
                scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[]),
            )

        req = request("mapped")
        assert sched.matched_tokens(req, 0) == (48, True)  # the 4th block stays in the refreshed tail
        sched.allocated(req, SimpleNamespace(get_block_ids=lambda: [[7, 3, 9]]), 48)
        first = sched.steps(step())  # the asynchronous load goes out; the request waits for it
        (load,) = first.loads
        assert load.token_ids == prompt[:64] and load.check == 16 and not first.checks
        second = sched.steps(step([("mapped", 48)]))  # loaded: vLLM computes tokens 48..79 in this step
        (check,) = second.checks
        assert (check.signal, check.start, check.token_ids, check.block_ids) == (
            "drift",
            48,
            prompt[:64],
            [7, 3, 9, 1, 4],
        )

        _policy_file(f, **entry, shadow_percent=100.0)
        shadowed = request("shadowed")
        assert sched.matched_tokens(shadowed, 0) == (0, False)  # served by the engine's own prefill
        (check,) = sched.steps(step([("shadowed", 0)])).checks
        assert (check.signal, check.start, check.token_ids, check.source) == ("shadow", 0, prompt[:48], source)

        true = [(torch.ones(1, 2, 16, 8), torch.ones(1, 2, 16, 8))] * 2
        sched.observe([Sample("1.0.0", "shadow", kv_drift(true, true))])
        assert sched.policy.off_reason("S__S-self") == ""
        sched.observe([Sample("1.0.0", "shadow", kv_drift([(k * 2, v * 2) for k, v in true], true))])
        assert sched.policy.off_reason("S__S-self").startswith("auto_disabled: shadow_rel_err mean 1.0000")
        assert sched.matched_tokens(request("later"), 0) == (0, False)
        sched.close()

"""--serve-refused-maps (kvferry.bench.refused): a bench times a map its gate refuses only when asked, and says so."""

import pytest
from conftest import ROOT

from kvferry.bench.harness import ServerProcess
from kvferry.bench.refused import FLAG, banner, bench_map
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.mappings.artifact import load, save, write_evidence

QWEN = "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b"


def test_a_refused_map_needs_the_flag_and_is_named_in_every_result():
    ms, served = bench_map(ROOT / "maps", "S__T", "", False)
    assert served is None and banner(served) == ""  # a map that serves needs nothing
    with pytest.raises(SystemExit, match=f"the gate refuses {QWEN} 0.6.1 .*only with {FLAG}"):
        bench_map(ROOT / "maps", QWEN, "0.6.1", False)
    ms, served = bench_map(ROOT / "maps", QWEN, "0.6.1", True)
    assert ms.version == "0.6.1" and served.startswith(f"{QWEN} 0.6.1: ") and "top10" in served
    assert banner(served).startswith(f"SERVING A MAP ITS GATE REFUSES ({FLAG}): {QWEN} 0.6.1")


def test_the_bench_sidecar_serves_a_refused_map_only_when_asked(tmp_path):
    ms = load(ROOT / "maps" / "S__T" / "1.1.0")
    write_evidence(save(ms, tmp_path), {"arms": {"mapped_refresh": {"top10": 0.1, "top1": 0.1, "kl": 9.0}}})
    for asked in (False, True):
        with (
            ServerProcess(tmp_path, serve_refused_maps=asked) as sc,
            TranslateClient(ClientOptions(target=sc.address)) as c,
        ):
            (info,) = c.list_mappings("S__T")
        assert info.servable is asked

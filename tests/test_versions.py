"""One semantic-version parser and one rule for which version serves, shared by the sidecar and every client
(the registry, the direct reader, the cascade and the vLLM connector used to carry four copies that disagreed)."""

import pytest

from kvferry.client.client import serving_mapping
from kvferry.client.rollout import MapRollout
from kvferry.common.listing import mapping_from_pb
from kvferry.mappings.errors import ArtifactError, InvalidInput
from kvferry.mappings.versions import is_version, serving_version, version_key
from kvferry.v1 import translate_pb2 as pb


def test_version_order_is_semver():
    versions = ["1.10.0", "1.2.0", "1.0.0", "1.2.0-rc.1", "0.9.9"]
    assert sorted(versions, key=version_key) == ["0.9.9", "1.0.0", "1.2.0-rc.1", "1.2.0", "1.10.0"]


@pytest.mark.parametrize("bad", ["01.0.0", "1.0", "latest", "1.0.0-", "v1.0.0", "1.0.0\n"])
def test_one_parser_refuses_what_artifacts_refuse(bad):
    assert not is_version(bad)
    with pytest.raises(ArtifactError):
        version_key(bad)
    if bad != "latest":
        with pytest.raises(InvalidInput, match="semantic version"):  # rollout took "01.0.0", which no artifact can be
            MapRollout(version=bad)


def test_serving_version():
    known = {"1.0.0": True, "1.1.0": True, "1.3.0": False, "1.2.0-rc.1": True}
    assert serving_version(known) == "1.2.0-rc.1"  # newest servable: 1.3.0 is gated off
    assert serving_version(known, "1.0.0") == "1.0.0"
    assert serving_version(known, "1.3.0") is None  # a pinned version that is gated serves nothing
    assert serving_version(known, "2.0.0") is None
    assert serving_version({"1.0.0": False}) is None and serving_version({}) is None


def test_clients_pick_what_the_sidecar_picks():
    """The direct reader, the cascade and the vLLM connector all read ListMappings through serving_mapping. Listed
    oldest-first, as ListMappings sorts them: the first servable one is not the one that serves."""
    listed = [
        mapping_from_pb(pb.MappingInfo(name="S__T", version=v, servable=s))
        for v, s in (("1.0.0", True), ("1.1.0", True), ("1.2.0", False))
    ]
    assert serving_mapping(listed, "S__T", "").version == "1.1.0"
    assert serving_mapping(listed, "S__T", "1.0.0").version == "1.0.0"
    assert serving_mapping(listed, "S__T", "1.2.0") is None
    assert serving_mapping(listed, "other", "") is None


def test_names_are_full_matched():
    from kvferry.mappings.artifact import check_name

    with pytest.raises(ArtifactError):
        check_name("S__T\n")  # `$` matched before a trailing newline
    assert check_name("S__T") == "S__T"

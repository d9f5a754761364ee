"""Numbers and files an operator names are checked where they are read: finite numbers in range (the range in the
refusal), secrets read only from bounded regular files (a FIFO or a device is refused at once, never waited on)."""

import os

import pytest

from kvferry.client.connector_config import ConnectorConfig
from kvferry.common.errors import InvalidInput
from kvferry.common.files import SECRET_LIMIT, read_secret_text, read_small_file
from kvferry.common.settings import check_range, read_setting
from kvferry.sidecar.auth import Authenticator
from kvferry.sidecar.config import SidecarConfig, from_sources

CONNECTOR = {"redis_url": "redis://127.0.0.1:6379/0", "prefix_secret": "s" * 32}


@pytest.mark.parametrize("raw", ["nan", "NaN", float("nan")])
def test_nan_is_never_a_setting(raw):
    with pytest.raises(InvalidInput, match="expected a number"):
        read_setting("timeout", "float", raw)


def test_a_range_names_itself_and_refuses_infinities():
    check_range("x", 0.5, 0, 1)
    for bad in (float("inf"), float("-inf"), float("nan"), -0.1, 1.5):
        with pytest.raises(InvalidInput, match=r"x must be in \[0, 1\]"):
            check_range("x", bad, 0, 1)
    with pytest.raises(InvalidInput, match=r"\(0, 1\]"):
        check_range("x", 0, 0, 1, low_open=True)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "1e9"])
def test_the_connectors_timeout_is_a_finite_positive_number_of_seconds(value):
    with pytest.raises(InvalidInput, match=r"kvferry connector: .*timeout"):
        ConnectorConfig.from_extra(CONNECTOR | {"timeout": value})
    assert ConnectorConfig.from_extra(CONNECTOR | {"timeout": "2.5"}).timeout == 2.5


@pytest.mark.parametrize(
    "name,value",
    [
        ("PREFIX_TTL_SECONDS", "nan"),
        ("PREFIX_TTL_SECONDS", "inf"),
        ("PREFIX_TTL_SECONDS", "0"),
        ("MAX_STREAM_SECONDS", "inf"),
        ("RELOAD_SECONDS", "-1"),
        ("DRAIN_SECONDS", "1e12"),
    ],
)
def test_the_sidecars_durations_are_finite_and_in_range(name, value):
    with pytest.raises(InvalidInput, match=f"{name.lower()}"):
        from_sources(None, env={f"KVFERRY_{name}": value})


def _fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return str(path)


def test_a_fifo_or_a_device_is_refused_as_a_secret_file_at_once(tmp_path):
    """Neither is waited on nor read without end: the refusal names the setting."""
    fifo = _fifo(tmp_path)
    for path in (fifo, "/dev/zero", str(tmp_path)):
        with pytest.raises(InvalidInput, match=r"prefix_secret_file .* is not a regular file"):
            SidecarConfig(prefix_secret_file=path).secret("prefix_secret")
        with pytest.raises(InvalidInput, match="is not a regular file"):
            ConnectorConfig.from_extra({"redis_url": CONNECTOR["redis_url"], "prefix_secret_file": path}).secret()
        with pytest.raises(InvalidInput, match=r"auth_tokens_file .* is not a regular file"):
            Authenticator.from_file(path)


def test_a_secret_file_is_read_with_a_limit(tmp_path):
    ok = tmp_path / "secret"
    ok.write_text("  hunter2-hunter2-hunter2 \n")
    assert read_secret_text(str(ok), "prefix_secret_file") == "hunter2-hunter2-hunter2"
    big = tmp_path / "big"
    big.write_bytes(b"x" * (SECRET_LIMIT + 1))
    with pytest.raises(InvalidInput, match="larger than"):
        read_small_file(str(big), "prefix_secret_file")
    assert len(read_small_file(str(big), "tls_cert", SECRET_LIMIT + 1)) == SECRET_LIMIT + 1
    with pytest.raises(InvalidInput, match="cannot read prefix_secret_file"):
        read_small_file(str(tmp_path / "missing"), "prefix_secret_file")
    binary = tmp_path / "bin"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InvalidInput, match="not UTF-8"):
        read_secret_text(str(binary), "prefix_secret_file")

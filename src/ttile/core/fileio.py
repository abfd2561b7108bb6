"""The one way ttile writes a file that others read: whole or not at all.

Tables, records' snapshots, generated kernels, cached libraries and machine models are
read by other processes (the build, a second tuner, a later ``conv2d``), so a reader must
never see half a file: data goes to a temporary file in the same directory, is flushed to
disk (fsync), and is renamed over the target, and the directory entry is flushed too so
that the rename survives a crash.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Union


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Flush ``tmp`` (a complete file in ``path``'s directory) and rename it to ``path``.

    For files written by another program (the compiler's output); :func:`atomic_write`
    uses it for data in memory.
    """
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_directory(Path(path).parent)


def atomic_write(path: Union[str, Path], data: Union[bytes, str], mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` atomically with permissions ``mode``; the directory must
    exist. On any error the temporary file is removed and the target left as it was."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.chmod(tmp, mode)
        publish(Path(tmp), path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_if_changed(path: Union[str, Path], text: str) -> bool:
    """Atomically write ``text`` unless the file already holds exactly it (keeps a
    build's timestamps, and a diff's noise, down). Returns whether it wrote."""
    path = Path(path)
    try:
        if path.read_text() == text:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    atomic_write(path, text)
    return True

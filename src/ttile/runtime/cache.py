"""The on-disk cache of kernels tuned at run time, built so that it cannot hurt anyone.

One entry per problem: ``<digest>.json`` (what was tuned, by whom, for which machine)
and, when a kernel beat the generic one, ``<digest>.so`` (the compiled kernel). The
digest hashes everything that makes an entry valid: the problem, the layout, the thread
count, the CPU fingerprint, the compiler, ttile's version and the generator's version.

Why each safeguard exists:

* Writers take an exclusive ``flock`` on ``<digest>.lock`` while tuning, so two
  processes meeting the same unseen shape tune it once; the second finds the entry.
* Files are written under a temporary name and renamed into place, the library first
  and the JSON last, so a reader sees a whole entry or none.
* The JSON carries the SHA-256 of the library and of its own fields: a truncated or
  corrupted entry is detected, deleted and tuned again instead of being loaded.
* An entry is loaded only if the JSON says ttile wrote it for exactly this key, and
  both files belong to this user and are not writable by others: a shared or planted
  cache directory cannot make the process load someone else's code.

Kept free of heavy imports: :mod:`ttile.dispatch` consults it on the first call of a
shape.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Iterator, Optional

from ..core.fileio import atomic_write
from ..core.kinds import KernelKind
from ..core.spec import ConvSpec

#: 2: entries name the problem their kernel was compiled for and count the candidates
#: the search found wrong or could not build.
#: 3: kernels take the fused epilogue as a fifth argument (generator version 4).
#: 4: kernels tuned at run time prefetch their weights (codegen.WEIGHT_PREFETCH_STEPS):
#: entries of format 3 hold kernels without, and are tuned again.
CACHE_FORMAT = 4
WRITER = "ttile"
#: Entry kinds: a compiled kernel (KernelKind.JIT), or the verdict that the generic
#: kernel was faster (KernelKind.GENERIC, remembered so later processes do not search).
ENTRY_KINDS = (KernelKind.JIT, KernelKind.GENERIC)


class CacheUnavailable(OSError):
    """The cache directory cannot be created or written (read-only, full, no rights)."""


@dataclass(frozen=True, kw_only=True)
class CacheKey:
    """Everything a cached kernel depends on; its digest names the entry's files."""

    problem: str            # ConvSpec.key(): shape, stride, padding
    layout: str
    threads: int
    cpu: str                # CpuFingerprint.id
    compiler: str           # path and first line of --version
    ttile_version: str
    generator_version: int
    isa: str = "avx512f"    # the vector family searched (Isa value)

    def digest(self) -> str:
        data = asdict(self)
        if self.isa == "avx512f":   # the digest of entries made before AVX2 kernels
            del data["isa"]
        text = json.dumps(data, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, kw_only=True)
class CacheEntry:
    """What the run-time tuner decided for one key."""

    key: CacheKey
    problem: ConvSpec                 # what the kernel was compiled for (checked on use)
    kind: KernelKind                  # JIT or GENERIC
    function: str = ""                # symbol of the kernel in the library
    panel: int = 0                    # weight panel width the kernel reads
    scheme: str = ""                  # paper notation
    microkernels: str = ""
    gflops: float = 0.0               # measured when tuned (warm, median)
    generic_gflops: float = 0.0       # the generic kernel in the same measurement
    search_seconds: float = 0.0
    measured: int = 0                 # candidates checked correct and timed
    wrong: int = 0                    # candidates that computed a wrong result
    failed: int = 0                   # candidates that did not build (error or time-out)
    library: Optional[Path] = None    # set on entries read back from disk
    payload: Optional[bytes] = field(default=None, repr=False)  # the verified library bytes

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("library", "payload")}
        data["key"] = asdict(self.key)
        data["problem"] = self.problem.to_json()
        data["kind"] = self.kind.value
        return data


def default_directory() -> Path:
    """$TTILE_CACHE_DIR, else the user cache directory (platformdirs when installed,
    else $XDG_CACHE_HOME or ~/.cache), under ttile/."""
    explicit = os.environ.get("TTILE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    try:
        from platformdirs import user_cache_dir
        return Path(user_cache_dir("ttile", appauthor=False))
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "ttile"


def _json_checksum(data: dict) -> str:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _trusted(path: Path) -> bool:
    """A regular file of this user that nobody else may write."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return (stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
            and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


class KernelCache:
    """Entries under ``<directory>/kernels-v<format>/``."""

    def __init__(self, directory: Optional[Path] = None):
        self.root = Path(directory) if directory is not None else default_directory()
        self.directory = self.root / f"kernels-v{CACHE_FORMAT}"
        #: why the last :meth:`lookup` refused an entry it found ("" : it refused none)
        self.rejected = ""

    # -- paths -------------------------------------------------------------------------
    def _paths(self, key: CacheKey) -> tuple[Path, Path, Path]:
        digest = key.digest()
        return (self.directory / f"{digest}.json", self.directory / f"{digest}.so",
                self.directory / f"{digest}.lock")

    def ensure_writable(self) -> None:
        """Create the directory (mode 0700) or raise CacheUnavailable saying why."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            probe = tempfile.NamedTemporaryFile(dir=self.directory, prefix=".probe-",
                                                delete=True)
            probe.close()
        except OSError as exc:
            raise CacheUnavailable(exc.errno or errno.EIO,
                                   f"cannot write the kernel cache {self.directory}: "
                                   f"{exc.strerror or exc}") from None

    # -- reading -----------------------------------------------------------------------
    def lookup(self, key: CacheKey) -> Optional[CacheEntry]:
        """The valid entry for ``key``, or None. An invalid one (corrupted, truncated,
        for another key, not ours) is removed when we may, and never returned."""
        meta_path, lib_path, _ = self._paths(key)
        self.rejected = ""
        if not meta_path.exists():
            return None
        entry = self._read(key, meta_path, lib_path)
        if isinstance(entry, str):
            self.rejected = entry
            self._discard(meta_path, lib_path)
            return None
        return entry

    def _read(self, key: CacheKey, meta_path: Path, lib_path: Path) -> "CacheEntry | str":
        """The entry, or why it is refused."""
        if not _trusted(meta_path):
            return "its record is not a private file of this user"
        try:
            data = json.loads(meta_path.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return "its record does not read as JSON"
        if not isinstance(data, dict) or data.get("writer") != WRITER \
                or data.get("format") != CACHE_FORMAT or data.get("checksum") != _json_checksum(data):
            return "its record's checksum or format does not match"
        if data.get("key") != asdict(key):
            return "its record is for another key"
        try:
            entry = CacheEntry(key=key, problem=ConvSpec.from_json(data["problem"]),
                               kind=KernelKind(data["kind"]), **{k: data[k] for k in (
                                   "function", "panel", "scheme", "microkernels", "gflops",
                                   "generic_gflops", "search_seconds", "measured", "wrong",
                                   "failed")})
        except (KeyError, TypeError, ValueError):
            return "its record lacks fields"
        if entry.problem.key() != key.problem or entry.kind not in ENTRY_KINDS:
            return "its record is for another problem"
        if entry.kind is KernelKind.GENERIC:
            return entry
        if not entry.function or entry.panel < 1:
            return "its record names no kernel"
        if not _trusted(lib_path):
            return "its library is not a private file of this user"
        try:
            payload = lib_path.read_bytes()
        except OSError:
            return "its library cannot be read"
        if len(payload) != data.get("library_size") \
                or hashlib.sha256(payload).hexdigest() != data.get("library_sha256"):
            return "its library's bytes differ from the checksum in its record"
        # The caller loads these verified bytes, not the file, which may change after
        # this check (and which another process may replace while we run).
        return replace(entry, library=lib_path, payload=payload)

    def _discard(self, *paths: Path) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink()

    # -- writing -----------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: CacheKey) -> Iterator[None]:
        """Exclusive lock on the key among processes (blocks while another tunes it).

        Raises CacheUnavailable when the lock file cannot be created.
        """
        import fcntl
        _, _, lock_path = self._paths(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise CacheUnavailable(exc.errno or errno.EIO,
                                   f"cannot lock in {self.directory}: {exc.strerror or exc}"
                                   ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def store(self, entry: CacheEntry, library: Optional[Path]) -> CacheEntry:
        """Write ``entry`` (and a copy of ``library`` for a JIT entry) atomically.

        Returns the entry as read back. Raises CacheUnavailable on any OS error (full
        disk, read-only directory); a half-written entry is removed first.
        """
        meta_path, lib_path, _ = self._paths(entry.key)
        data = entry.to_json()
        data.update(writer=WRITER, format=CACHE_FORMAT)
        written: list[Path] = []
        payload = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            if entry.kind is KernelKind.JIT:
                if library is None:
                    raise ValueError("a JIT entry needs its library")
                payload = Path(library).read_bytes()
                atomic_write(lib_path, payload, mode=0o600)
                written.append(lib_path)
                data["library_size"] = len(payload)
                data["library_sha256"] = hashlib.sha256(payload).hexdigest()
            data["checksum"] = _json_checksum(data)
            atomic_write(meta_path, json.dumps(data, sort_keys=True, indent=1) + "\n",
                         mode=0o600)
        except OSError as exc:
            self._discard(*written)
            raise CacheUnavailable(exc.errno or errno.EIO,
                                   f"cannot write the kernel cache {self.directory}: "
                                   f"{exc.strerror or exc}") from None
        jit = entry.kind is KernelKind.JIT
        return replace(entry, library=lib_path if jit else None, payload=payload if jit else None)

    # -- listing and clearing ----------------------------------------------------------
    def entries(self) -> list[dict]:
        """Every entry's JSON as stored (valid or not), with its file name and validity."""
        out = []
        if not self.directory.is_dir():
            return out
        for meta_path in sorted(self.directory.glob("*.json")):
            try:
                data = json.loads(meta_path.read_text())
            except (OSError, ValueError, UnicodeDecodeError):
                data = {}
            if not isinstance(data, dict):
                data = {}
            data["file"] = meta_path.name
            data["valid"] = bool(data) and data.get("checksum") == _json_checksum(
                {k: v for k, v in data.items() if k not in ("file", "valid")})
            out.append(data)
        return out

    def clear(self) -> int:
        """Remove every file of the cache directory; returns how many were removed."""
        removed = 0
        if not self.directory.is_dir():
            return 0
        for path in self.directory.iterdir():
            if path.is_file() or path.is_symlink():
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
        return removed

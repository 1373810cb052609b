"""Where a version's verified bucket payloads wait for SGLang's own disk load: files in memory.

A bucket body is written straight into a file of its exact size as it arrives (one copy from
the socket's chunks, no second buffer; a local source file is copied in the kernel), verified in
place through a mapping, then renamed into its attempt's directory as
``bucket-<index>.safetensors`` next to the ``adapter_config.json`` written at ``end``. The
scheduler loads that directory through SGLang's stock path load (``LoadLoRAAdapterReqInput``),
the same path a stock ``/load_lora_adapter`` takes, so no tensor is pickled through ZMQ.

Why this is safe:
- the directory belongs to this process (``0700``, created with ``O_EXCL``, names chosen here,
  never from the request), so no control call can point a load at another file;
- a file is written only before it is verified and never after: the load reads exactly the
  bytes that were checked;
- the files are removed once the version is READY (the scheduler keeps its own mapping), when
  the attempt is cleaned up, and the whole owner directory at exit; a later engine removes the
  directories of owners that died without doing so (``sweep_dead_owners``).

The root is ``/dev/shm`` (RAM, like the memory the pickle path used) unless
``SGLANG_LORA_VERSIONS_STAGING_DIR`` names another directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import mmap
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.wire_models import invalid

STAGING_DIR_ENV = "SGLANG_LORA_VERSIONS_STAGING_DIR"
# A local source file is copied in ranges of at most this size.
COPY_STRIDE_BYTES = 4 * 1024 * 1024
LOCAL_SOURCE_DIR_ENV = "SGLANG_LORA_VERSIONS_LOCAL_SOURCE_DIR"
_OWNER_PREFIX = "sglang-lora-versions-"
_OWNER_RE = re.compile(rf"^{_OWNER_PREFIX}(\d+)-[0-9a-f]{{12}}$")
# room kept free on the staging filesystem beyond what a version needs
_ROOM_SLACK_BYTES = 16 * 1024 * 1024


def default_staging_base() -> Path:
    configured = os.environ.get(STAGING_DIR_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


@dataclass
class StagedPart:
    """One bucket in this process's directory, not yet accepted: a file of exactly ``size``
    bytes, mapped (for reading, and writable while being filled; read-only when taken over).

    A part this process fills keeps its fd, and its bytes go in through it (:meth:`write`,
    :meth:`copy_from`), never through the mapping: the file is sparse (no up-front allocation,
    which cost a 27 MiB bucket 7.5 ms here, and a page fault per 4 KiB page on the mapped copy
    another 16 ms), and a full filesystem is then an error of the write (a typed refusal), where
    a store into a mapped page of a sparse file would be a SIGBUS that ends the engine."""

    path: Path
    size: int
    _map: mmap.mmap | None = field(default=None, repr=False)
    writable: bool = True
    _fd: int | None = field(default=None, repr=False)

    @property
    def view(self) -> memoryview:
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Write ``data`` at ``offset`` through the file (PAYLOAD_TOO_LARGE when it is full)."""
        view = memoryview(data)
        while view:
            n = self._io(os.pwrite, view, offset)
            view, offset = view[n:], offset + n

    def copy_from(self, src_fd: int, start: int, end: int, what: str = "source file") -> None:
        """Copy bytes ``start..end`` of ``src_fd`` (``what``, in errors) to the same offsets of
        this part, in the kernel (``copy_file_range``: no pass through this process's memory).
        A source that ends early or cannot be read is INCOMPLETE_BODY; this part's own write
        errors are :meth:`write`'s."""
        pos = start
        while pos < end:
            try:
                got = self._io(_copy_range, src_fd, pos, min(end - pos, COPY_STRIDE_BYTES))
            except SourceUnreadable as exc:
                raise LoraVersionError(ErrorCode.INCOMPLETE_BODY, f"{what} unreadable: {exc}") from None
            if got <= 0:
                raise LoraVersionError(
                    ErrorCode.INCOMPLETE_BODY,
                    f"{what} ended after {pos} bytes, expected {end}",
                    received=pos,
                )
            pos += got

    def _io(self, call: Callable[..., int], *args: object) -> int:
        if self._fd is None:
            raise RuntimeError(f"{self.path.name} is not written by this process")
        try:
            return call(self._fd, *args)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise LoraVersionError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"no room for a {self.size}-byte bucket in {self.path.parent.parent}: {exc.strerror}",
                    limit=self.size,
                ) from None
            raise

    def unmap(self) -> None:
        """Drop the mapping and the fd (the bytes stay in the file). Views still exported keep
        the mapping alive until they are released: then the close is left to the collector."""
        m, self._map = self._map, None
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if m is not None:
            with contextlib.suppress(BufferError):
                m.close()


class SourceUnreadable(Exception):
    """The source side of a copy failed (its read), as opposed to the part's write."""


def _copy_range(dst_fd: int, src_fd: int, pos: int, count: int) -> int:
    """``count`` bytes at ``pos`` of ``src_fd`` into ``dst_fd`` at the same offset: in the kernel
    where it can, else a read and a write. A full destination fails as it is (the part's
    refusal); any other failure of the kernel copy (none on a kernel or filesystem without it:
    EXDEV, ENOSYS, ...; an EIO, which does not say whose) is retried as a read and a write,
    whose errors say which side failed: the read's is :class:`SourceUnreadable`."""
    try:
        return os.copy_file_range(src_fd, dst_fd, count, pos, pos)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
    try:
        data = os.pread(src_fd, count, pos)
    except OSError as exc:
        raise SourceUnreadable(exc.strerror or str(exc)) from None
    done = 0
    while done < len(data):
        done += os.pwrite(dst_fd, memoryview(data)[done:], pos + done)
    return len(data)


@dataclass
class LocalSource:
    """A local source: taken over as a private part, or an fd to copy from (and a moved file
    to delete once copied)."""

    part: StagedPart | None = None
    fd: int | None = None
    moved: Path | None = None

    def discard_moved(self) -> None:
        if self.moved is not None:
            self.moved.unlink(missing_ok=True)


# populate a taken-over mapping at once (one pass in the kernel, not a fault per page)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _make_private(fd: int) -> bool:
    """True once ``fd``'s file has one link, no writer (a read lease was granted: the kernel
    refuses it while the file is open for writing or mapped writable), and mode 0400."""
    if os.fstat(fd).st_nlink != 1:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:  # EAGAIN: a writer; EACCES: not our file; EINVAL: no leases here
        return False
    try:
        os.fchmod(fd, 0o400)
    except OSError:
        return False
    finally:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True


class StagingArea:
    """This process's staging directory: one subdirectory per attempt."""

    def __init__(self, base: Path | None = None) -> None:
        self.base = Path(base) if base is not None else default_staging_base()
        self.base.mkdir(parents=True, exist_ok=True)
        sweep_dead_owners(self.base)
        # the sweepable name (owner pid, 12 random hex chars); mkdir refuses one that exists
        self.root = self.base / f"{_OWNER_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        self.root.mkdir(mode=0o700)
        self._dirs: dict[tuple[str, str], Path] = {}
        self._seq = itertools.count()

    # -- attempts ---------------------------------------------------------------------------

    def attempt_dir(self, key: tuple[str, str]) -> Path:
        """The attempt's directory (created on first use). Named by a counter, never by the
        request's strings."""
        d = self._dirs.get(key)
        if d is None:
            d = self.root / f"attempt-{next(self._seq)}"
            d.mkdir(mode=0o700)
            self._dirs[key] = d
        return d

    def has_attempt(self, key: tuple[str, str]) -> bool:
        return key in self._dirs

    def remove(self, key: tuple[str, str]) -> None:
        d = self._dirs.pop(key, None)
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        self._dirs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- room -------------------------------------------------------------------------------

    def check_room(self, nbytes: int, what: str) -> None:
        """Refuse (PAYLOAD_TOO_LARGE, before any data moves) a version the staging filesystem
        cannot hold."""
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        if nbytes + _ROOM_SLACK_BYTES > free:
            raise LoraVersionError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"{what}: {nbytes} bytes do not fit in the staging directory {self.base} "
                f"({free} bytes free); set {STAGING_DIR_ENV} to a larger one",
                limit=free,
            )

    # -- bucket files -----------------------------------------------------------------------

    def new_part(self, size: int, written_here: bool = True) -> StagedPart:
        """A fresh sparse file of ``size`` bytes, mapped. It lies outside every attempt's
        directory until :meth:`commit_part`, so a cleanup that races an upload never sees half a
        bucket, and a load never reads one.

        ``written_here``: this process fills it through the part's fd (:meth:`StagedPart.write`,
        :meth:`StagedPart.copy_from`), so a full filesystem is a typed error. ``False``: another
        process fills it (the collective receiver: a full filesystem ends that process, a typed
        error here); this one only reads it."""
        path = self.root / f"incoming-{next(self._seq)}.part"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            mapping: mmap.mmap | None = None
            if size:
                os.ftruncate(fd, size)
                mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        if not written_here:
            os.close(fd)  # the mapping keeps the file's pages; no fd outlives this call
            return StagedPart(path=path, size=size, _map=mapping)
        return StagedPart(path=path, size=size, _map=mapping, _fd=fd)

    def take_local_source(self, source_dir: Path | None, name: str) -> LocalSource:
        """The local source file ``name``, taken over when it can be made private, else opened.

        Taken over (no copy): renamed into this process's directory (same filesystem), then
        checked to be a regular file with one link that nobody has open for writing (a read
        lease is granted only then, writable mappings included), made read-only, and mapped.
        From then on no path leads to it but ours, and no writer holds it: what is verified is
        what the scheduler loads. Otherwise (another filesystem, another link, a writer, another
        owner) it is opened for the copy path (:meth:`BucketReceiver.fill_from_file`), which
        verifies a private copy instead; a file already moved is deleted once copied."""
        if source_dir is None:
            raise invalid(f"this engine takes bucket bodies only: {LOCAL_SOURCE_DIR_ENV} is not set")
        moved = self.root / f"incoming-{next(self._seq)}.part"
        try:
            os.rename(source_dir / name, moved)
        except FileNotFoundError:
            raise invalid(f"no bucket source {name!r} in the local source directory") from None
        except OSError:
            return LocalSource(fd=open_local_source(source_dir, name))  # e.g. EXDEV: copy it
        try:
            fd = open_local_source(self.root, moved.name)  # a moved symlink or FIFO is refused here
        except BaseException:
            moved.unlink(missing_ok=True)
            raise
        if not _make_private(fd):
            return LocalSource(fd=fd, moved=moved)
        size = os.fstat(fd).st_size
        try:
            mapping = (
                mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)
                if size
                else None
            )
        except BaseException:
            os.close(fd)
            moved.unlink(missing_ok=True)
            raise
        os.close(fd)
        return LocalSource(part=StagedPart(path=moved, size=size, _map=mapping, writable=False))

    def commit_part(self, key: tuple[str, str], part: StagedPart, index: int) -> None:
        """The verified part becomes the attempt's bucket ``index`` (an atomic rename)."""
        part.unmap()
        part.path.rename(self.attempt_dir(key) / _bucket_file_name(index))

    def bucket_files(self, key: tuple[str, str]) -> list[Path]:
        d = self._dirs.get(key)
        return sorted(d.glob("bucket-*.safetensors")) if d is not None else []

    def check_bucket_files(self, key: tuple[str, str], buckets: int) -> None:
        """The attempt's directory holds exactly buckets ``0..buckets-1`` (MANIFEST_MISMATCH
        otherwise: nothing else may reach the load)."""
        names = [f.name for f in self.bucket_files(key)]
        if names != [_bucket_file_name(i) for i in range(buckets)]:
            raise LoraVersionError(
                ErrorCode.MANIFEST_MISMATCH,
                f"the staged files are not the {buckets} planned buckets",
                staged=names[:20],
            )

    @staticmethod
    def discard_part(part: StagedPart) -> None:
        part.unmap()
        part.path.unlink(missing_ok=True)

    def write_config(self, key: tuple[str, str], config_json: bytes) -> Path:
        d = self.attempt_dir(key)
        (d / "adapter_config.json").write_bytes(config_json)
        return d


def _bucket_file_name(index: int) -> str:
    return f"bucket-{index:05d}.safetensors"


def sweep_dead_owners(base: Path) -> list[Path]:
    """Remove the staging directories of processes that are gone (killed before their exit
    hook ran). Only directories named by this module are touched."""
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for entry in base.iterdir():
            m = _OWNER_RE.match(entry.name)
            if not m or not entry.is_dir() or entry.is_symlink():
                continue
            if not _pid_alive(int(m.group(1))):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def local_source_dir() -> Path | None:
    """The directory a trainer on this host may hand buckets over in (None: not enabled)."""
    configured = os.environ.get(LOCAL_SOURCE_DIR_ENV)
    return Path(configured) if configured else None


def open_local_source(source_dir: Path | None, name: str) -> int:
    """An fd on the regular file ``name`` of the local source directory, for reading.

    ``name`` is a bare file name (the wire model checked it: no separator, no leading dot), the
    last component is never followed if it is a symlink, and the open never blocks (a FIFO
    planted there is refused, not waited on). The engine reads only what the operator put under
    that directory, and copies it before verifying it."""
    if source_dir is None:
        raise invalid(f"this engine takes bucket bodies only: {LOCAL_SOURCE_DIR_ENV} is not set")
    try:
        fd = os.open(source_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise invalid(f"no bucket source {name!r} in the local source directory") from None
    except OSError as exc:
        raise invalid(f"bucket source {name!r} cannot be opened: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise invalid(f"bucket source {name!r} is not a regular file")
    return fd

"""The snapshot directory: content-addressed page files and snapshot manifests on disk.

Owns: one engine's folder inside a snapshot directory, and every write, rename, sync and
read there (the crash-safe I/O); what the files hold and how a read is checked is
``runtime.kv.file_format``'s. It knows files only (bytes in, bytes out); which pages
exist and who references them is the disk tier's (``runtime.kv.tier``). Layout
(docs/snapshots.md)::

    DIR/                            the snapshot directory (--snapshot-dir)
      <fingerprint key>/            one folder per model fingerprint (16 hex digits)
        FORMAT.json                 the fingerprint in full: who wrote these files
        LOCK                        flock()ed by the engines using the folder
        pages/<hash>.page           one committed page, named by its chained hash
        snapshots/<key>.snap        one manifest, key = digest of (namespace, name)
        tmp/                        files being written; emptied at open
          <engine>/, <engine>.lock  a sharing engine's own temp files, and its lock

One engine, or many (``shared=True``, a fleet on one folder, docs/scale-out.md). An
engine alone holds ``LOCK`` exclusively; sharing engines hold it shared, so an engine
alone and sharing engines never meet (the second gets ``StorageError``). Sharing engines
each write their temp files into their own ``tmp/<engine>/`` (kept by a lock of their
own, so the next engine to open the folder removes only the folders of engines that
died). The rules that make sharing safe: a page file is named by its content's hash and
never changes, so writing one that exists is skipped (``write_many``), and one being
written is invisible until its rename; a manifest is replaced by rename, so when two
engines save one name at once the last rename wins whole; nothing deletes page files
(``runtime.kv.tier``).

Crash safety: every file is written to ``tmp/``, fsynced, renamed into place, and its
folder fsynced (``write_atomic``), so a file under ``pages/`` or ``snapshots/`` is either
absent or complete. A save writes its pages before its manifest, so a listed manifest's
pages exist. Every file ends with an xxh3-64 checksum of what precedes it, checked on
every read; a page file also repeats its tokens, positions, extras and parent hash, and
reading it recomputes the chained hash from them (``runtime.kv.file_format``).

Reading many pages (a reopen): ``read_pages`` reads the files with several threads (the
disk serves parallel reads faster than one stream; the GIL is released in the reads and
the checksums), each page's KV bytes straight into the caller's buffer, and verifies each
file as ``read_page`` does. It touches no torch object, so its threads never start a torch
thread team.

Errors: ``StorageError`` (a folder is missing, read-only or in use; a write failed, e.g.
ENOSPC) and ``SnapshotCorrupt`` (a file fails its checks), each naming the path.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pie_ctx.proto.errors import SnapshotCorrupt, StorageError
from runtime.kv.file_format import (
    PAGE_HEAD,
    SUM,
    Fingerprint,
    ManifestHead,
    PageRecord,
    manifest_key,
    manifest_parts,
    page_front_fits,
    page_parts,
    parse_blob,
    parse_page,
    read_head,
    verify_page,
)
from runtime.kv.types import PageHash

__all__ = ["FileOps", "PageFiles"]

log = logging.getLogger("pie_ctx.snapshots")

_BATCH_FILES = 256  # files a batched write keeps open at once (one syncfs each)
# Threads ``read_pages`` reads with: 256 cold page files (188 MB) took 0.20 s with one
# thread and 0.11-0.13 s with 4-16 on the 2-core Xeon VM (docs/performance.md).
READ_THREADS = 8


class FileOps:
    """The system calls that write files, in one place so tests can inject failures
    (ENOSPC, EIO, a crash between two of them)."""

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_batch(self, fds: Sequence[int]) -> None:
        """Make the data of every file open in ``fds`` (one file system) durable. Linux's
        syncfs(2) flushes them together, one journal commit instead of one per file (it
        also flushes other writers' dirty data on that file system); elsewhere each file is
        fsynced."""
        if fds and _SYNCFS is not None:
            if _SYNCFS(fds[0]) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            return
        for fd in fds:
            self.fsync(fd)


def _find_syncfs() -> Any:
    """libc's syncfs, or None (not Linux, or no glibc symbol)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


_SYNCFS = _find_syncfs()


def _write_error(path: Path, e: OSError) -> StorageError:
    why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else str(e)
    return StorageError(f"cannot write {path}: {why}; nothing was saved")


class PageFiles:
    """One engine's folder in a snapshot directory (see the module docstring).

    Args:
        root: the snapshot directory; it must exist and be writable.
        fingerprint: the engine's; its folder is created inside ``root`` if new.
        ops: the system calls (tests pass a subclass that fails on cue).
        shared: other engines of the same fingerprint may use the folder at the same time
            (see the module docstring).

    Raises:
        StorageError: ``root`` is missing, not a folder, read-only, or its folder for this
            fingerprint is locked by another engine (one alone; or, when not ``shared``,
            any).
    """

    def __init__(self, root: str | Path, fingerprint: Fingerprint,
                 ops: FileOps | None = None, shared: bool = False) -> None:
        self.root = Path(root).expanduser()
        self.fingerprint = fingerprint
        self.ops = ops or FileOps()
        if not self.root.is_dir():
            raise StorageError(f"snapshot directory {self.root} does not exist (or is not a "
                               "folder): create it, or pass another --snapshot-dir")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StorageError(f"snapshot directory {self.root} is not writable: fix its "
                               "permissions, or pass another --snapshot-dir")
        self.folder = self.root / fingerprint.key
        self.pages_dir = self.folder / "pages"
        self.snaps_dir = self.folder / "snapshots"
        self.tmp_dir = self.folder / "tmp"
        self.shared = shared
        self._counter = itertools.count()
        self._tmp_lock_fd = -1
        try:
            for d in (self.folder, self.pages_dir, self.snaps_dir, self.tmp_dir):
                d.mkdir(exist_ok=True)
            self._lock_fd = os.open(self.folder / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise StorageError(f"cannot use snapshot directory {self.root}: {e}") from None
        try:
            fcntl.flock(self._lock_fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
                        | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise StorageError(
                f"snapshot directory {self.folder} is in use by another running engine of "
                "the same model" + (" that does not share it (--shared-snapshots)" if shared
                                    else "") + "; stop it, or pass another --snapshot-dir"
                + ("" if shared else ", or start every engine with --shared-snapshots")
            ) from None
        self._sweep_tmp()
        if shared:
            self._own_tmp()
        format_file = self.folder / "FORMAT.json"
        if not format_file.exists():
            self.write_atomic(format_file, [json.dumps(asdict(fingerprint), indent=1).encode()])

    def _sweep_tmp(self) -> None:
        """Remove the temp files a crash left half-written: all of them for an engine
        alone; for a sharing one, the folders of sharing engines that are gone (their lock
        is free)."""
        for stale in self.tmp_dir.iterdir():
            if stale.suffix == ".lock" or stale.is_dir():
                continue
            if not self.shared:
                stale.unlink(missing_ok=True)
        for lock in list(self.tmp_dir.glob("*.lock")):
            try:
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its engine is alive
            else:
                folder = self.tmp_dir / lock.stem
                if folder.is_dir():
                    for stale in folder.iterdir():
                        stale.unlink(missing_ok=True)
                    folder.rmdir()
                lock.unlink(missing_ok=True)
            finally:
                os.close(fd)

    def _own_tmp(self) -> None:
        """A sharing engine's own temp folder, kept by a lock it holds until ``close``."""
        name = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            self._tmp_lock_fd = os.open(self.tmp_dir / f"{name}.lock",
                                        os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._tmp_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.tmp_dir = self.tmp_dir / name
            self.tmp_dir.mkdir()
        except OSError as e:
            self.close()
            raise StorageError(f"cannot use snapshot directory {self.root}: {e}") from None

    def close(self) -> None:
        """Release the folder's lock (the files stay; a sharing engine's temp folder
        goes)."""
        if self._tmp_lock_fd >= 0:
            if self.tmp_dir.is_dir() and self.tmp_dir.parent.name == "tmp":
                for stale in self.tmp_dir.iterdir():
                    stale.unlink(missing_ok=True)
                self.tmp_dir.rmdir()
                (self.tmp_dir.parent / f"{self.tmp_dir.name}.lock").unlink(missing_ok=True)
            os.close(self._tmp_lock_fd)
            self._tmp_lock_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ------------------------------------------------------------------------ writing

    def write_atomic(self, path: Path, parts: Sequence[bytes | memoryview],
                     durable: bool = True) -> int:
        """Write ``parts`` as the file ``path``: all of it or nothing, ever.

        Written to ``tmp/``, fsynced, renamed over ``path``, then the folder is fsynced
        (``durable=False`` skips both fsyncs: for cache pages a crash may lose).

        Returns:
            The bytes written.

        Raises:
            StorageError: the write failed (the message names ``path`` and the cause);
                nothing is left behind.
        """
        tmp, total = self._write_tmp(path, parts, durable)
        try:
            self.ops.replace(tmp, path)
            if durable:
                self.ops.fsync_dir(path.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _write_error(path, e) from None
        return total

    def write_many(self, files: Sequence[tuple[Path, Sequence[bytes | memoryview]]],
                   synced: Sequence[Path] = ()) -> list[Path]:
        """Write several files of one folder durably, paying for durability once: the files
        in ``synced`` (already in place) are fsynced, every temp file is written, all of
        them are made durable together (``FileOps.sync_batch``), then renamed into place,
        and the folder is fsynced once. ~2.5x faster than ``write_atomic`` per file here.

        Returns:
            The paths written (all of ``files``').

        Raises:
            StorageError: a write failed. Nothing was renamed into place unless the error's
                ``written`` attribute lists it (the caller removes those).
        """
        tmps: list[tuple[Path, Path]] = []
        done: list[Path] = []
        try:
            for path in synced:
                self.sync_file(path)
            for start in range(0, len(files), _BATCH_FILES):
                fds: list[int] = []
                try:
                    for path, parts in files[start:start + _BATCH_FILES]:
                        if self.shared and path.parent == self.pages_dir and path.exists():
                            done.append(path)  # another engine wrote it: the same bytes
                            continue
                        tmp, fd = self._create_tmp(path)
                        tmps.append((tmp, path))
                        fds.append(fd)
                        self._write_parts(fd, parts, path)
                    try:
                        self.ops.sync_batch(fds)
                    except OSError as e:
                        raise _write_error(files[start][0].parent, e) from None
                finally:
                    for fd in fds:
                        os.close(fd)
            for tmp, path in tmps:
                try:
                    self.ops.replace(tmp, path)
                except OSError as e:
                    raise _write_error(path, e) from None
                done.append(path)
            if files or synced:
                folder = (files[0][0] if files else synced[0]).parent
                try:
                    self.ops.fsync_dir(folder)
                except OSError as e:
                    raise _write_error(folder, e) from None
        except StorageError as err:
            for tmp, _ in tmps:
                tmp.unlink(missing_ok=True)
            err.written = done  # type: ignore[attr-defined]
            raise
        return done

    def _write_tmp(self, path: Path, parts: Sequence[bytes | memoryview],
                   durable: bool) -> tuple[Path, int]:
        """Write ``parts`` to a new file in ``tmp/`` (fsynced when ``durable``); returns it
        and the bytes written. On failure the temp file is gone."""
        tmp, fd = self._create_tmp(path)
        try:
            try:
                total = self._write_parts(fd, parts, path)
                if durable:
                    self.ops.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _write_error(path, e) from None
        except StorageError:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, total

    def _create_tmp(self, path: Path) -> tuple[Path, int]:
        """A new, empty file in ``tmp/`` for ``path``, open for writing."""
        tmp = self.tmp_dir / f"{path.name}.{os.getpid()}.{next(self._counter)}"
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise _write_error(path, e) from None

    def _write_parts(self, fd: int, parts: Sequence[bytes | memoryview], path: Path) -> int:
        """Write every byte of ``parts`` to ``fd`` (looping over short writes)."""
        total = 0
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    n = self.ops.write(fd, view)
                    view = view[n:]
                    total += n
        except OSError as e:
            raise _write_error(path, e) from None
        return total

    def sync_file(self, path: Path) -> None:
        """fsync an existing file (a cache page becoming part of a snapshot).

        Raises:
            StorageError: the file is gone or the fsync failed.
        """
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                self.ops.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _write_error(path, e) from None

    def page_path(self, page_hash: int) -> Path:
        return self.pages_dir / f"{page_hash:016x}.page"

    def manifest_path(self, namespace: str, name: str) -> Path:
        return self.snaps_dir / f"{manifest_key(namespace, name)}.snap"

    def write_page(self, page_hash: int, parent: int, tokens: Sequence[int],
                   positions: Sequence[int], extras: Sequence[int],
                   payload: bytes | memoryview, durable: bool = True) -> int:
        """Write one committed page file; returns its size in bytes."""
        return self.write_atomic(self.page_path(page_hash),
                                 page_parts(page_hash, parent, tokens, positions, extras,
                                            payload), durable)

    def write_manifest(self, head: ManifestHead, tail: bytes | memoryview,
                       logits: bytes | memoryview) -> int:
        """Write (durably) one snapshot manifest; returns its size in bytes."""
        return self.write_atomic(self.manifest_path(head.namespace, head.name),
                                 manifest_parts(head, tail, logits))

    def remove(self, path: Path, durable: bool = True) -> None:
        """Delete a file (missing is fine); fsync its folder when ``durable``.

        Raises:
            StorageError: the unlink failed.
        """
        try:
            path.unlink(missing_ok=True)
            if durable:
                self.ops.fsync_dir(path.parent)
        except OSError as e:
            raise StorageError(f"cannot delete {path}: {e}") from None

    # ------------------------------------------------------------------------ reading

    def read_page(self, page_hash: int, payload_bytes: int) -> PageRecord:
        """Read and verify one page file.

        Args:
            page_hash: the page's chained hash (its file name).
            payload_bytes: the size a page's KV has in this engine's pool.

        Raises:
            SnapshotCorrupt: missing, truncated, wrong checksum, or contents that do not
                hash to ``page_hash``; the message names the file.
        """
        path = self.page_path(page_hash)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise SnapshotCorrupt(f"page file {path} cannot be read: {e}") from None
        return parse_page(path, page_hash, payload_bytes, data)

    def read_pages(self, hashes: Sequence[int], payload_bytes: int, out: memoryview,
                   threads: int = READ_THREADS) -> list[PageRecord | SnapshotCorrupt]:
        """Read and verify several page files at once, on ``threads`` threads.

        Args:
            hashes: the pages' chained hashes (their file names).
            payload_bytes: the size a page's KV has in this engine's pool.
            out: a writable buffer of ``len(hashes) * payload_bytes`` bytes: page ``i``'s KV
                bytes land in its ``i``-th slice, and its record's payload is that slice.

        Returns:
            For each hash, in order, its record or the ``SnapshotCorrupt`` that says why
            its file is missing or damaged (as ``read_page`` would raise it).
        """
        if not hashes:
            return []
        out = out.cast("B")
        if out.nbytes != len(hashes) * payload_bytes:
            raise RuntimeError(f"read_pages: a buffer of {out.nbytes} bytes for "
                               f"{len(hashes)} pages of {payload_bytes}")

        def one(i: int) -> PageRecord | SnapshotCorrupt:
            row = out[i * payload_bytes:(i + 1) * payload_bytes]
            try:
                return self._read_page_into(hashes[i], payload_bytes, row)
            except SnapshotCorrupt as err:
                return err

        if threads <= 1 or len(hashes) <= 1:
            return [one(i) for i in range(len(hashes))]
        with ThreadPoolExecutor(min(threads, len(hashes)),
                                thread_name_prefix="pie-ctx-read") as pool:
            return list(pool.map(one, range(len(hashes))))

    def _read_page_into(self, page_hash: int, payload_bytes: int,
                        row: memoryview) -> PageRecord:
        """``read_page``, with the KV bytes read into ``row`` (one ``preadv``, no copy).
        A file whose layout is not the expected one goes through ``read_page``, whose
        checks say what is wrong with it."""
        path = self.page_path(page_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise SnapshotCorrupt(f"page file {path} cannot be read: {e}") from None
        try:
            total = os.fstat(fd).st_size
            front = total - payload_bytes - SUM.size
            if front < PAGE_HEAD.size:
                got = -1
            else:
                meta, trailer = bytearray(front), bytearray(SUM.size)
                got = os.preadv(fd, [meta, row, trailer], 0)
        except OSError as e:
            raise SnapshotCorrupt(f"page file {path} cannot be read: {e}") from None
        finally:
            os.close(fd)
        if got == total and page_front_fits(meta, payload_bytes):
            return verify_page(path, page_hash, payload_bytes, memoryview(meta), row,
                               memoryview(trailer))
        record = self.read_page(page_hash, payload_bytes)  # raises, naming the flaw
        row[:] = record.payload  # (a file that changed while being read, and is fine now)
        return PageRecord(record.page_hash, record.parent, record.tokens, record.positions,
                          record.extras, row)

    def read_blob(self, head: ManifestHead) -> tuple[bytes, bytes]:
        """The manifest's working-tail KV bytes and last logits, verified.

        Raises:
            SnapshotCorrupt: the blob is missing, truncated or fails its checksum.
        """
        path = self.manifest_path(head.namespace, head.name)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise SnapshotCorrupt(f"manifest {path} cannot be read: {e}") from None
        return parse_blob(path, head, data)

    # ------------------------------------------------------------------------ listing

    def manifests(self) -> Iterator[tuple[Path, ManifestHead | SnapshotCorrupt]]:
        """Every manifest file with its head, or the error that makes it unreadable."""
        for path in sorted(self.snaps_dir.glob("*.snap")):
            try:
                head = read_head(path)
            except SnapshotCorrupt as err:
                yield path, err
                continue
            if head.fingerprint != self.fingerprint.key or \
                    path.stem != manifest_key(head.namespace, head.name):
                yield path, SnapshotCorrupt(f"manifest {path} belongs elsewhere")
                continue
            yield path, head

    def page_files(self) -> dict[PageHash, int]:
        """Every page file on disk: hash -> size in bytes."""
        out: dict[PageHash, int] = {}
        for entry in os.scandir(self.pages_dir):
            stem, dot, ext = entry.name.partition(".")
            if dot and ext == "page" and len(stem) == 16:
                try:
                    out[PageHash(int(stem, 16))] = entry.stat().st_size
                except ValueError:
                    continue
        return out



"""The ``file://`` blob store: a local (or shared, mounted) directory, one file per blob.

Layout under the root::

    <name>                                      the blob's bytes, exactly; ``a/b/c`` is the file ``a/b/c``
    <dir>/.statebackend~tmp.<random>            a write in progress (or left by a crash); never listed
    .statebackend~meta/<hh>/<sha256(name)>.<inode>.json   user metadata of the blob whose file has that inode

How the contract of :mod:`statebackend.blobstores.base` is met:

- ``put`` writes a temp file in the target directory, fsyncs it, then ``os.replace`` s it onto the name, and fsyncs
  the directory: a reader sees the old file or the new one, never a part.
- ``create_only`` hard-links the finished temp file to the name: ``link`` fails with ``EEXIST`` atomically, so the
  check and the write are one step (create-only *and* atomic content, which ``O_EXCL`` alone cannot give).
- Metadata is keyed by the blob file's inode and written (and fsynced) before the blob is linked in, so a blob and
  its metadata appear together, also across a crash; replacing a blob orphans the old inode's metadata, which is
  then removed. ``set_metadata`` rewrites only the small metadata file.
- Names are checked with :func:`check_blob_name`; names with a segment that starts with ``.statebackend~`` are
  reserved for the files above and rejected, so ``list`` can skip them without hiding a blob. Symlinks inside the
  root that point outside it are out of scope: the operator owns the directory.
- Limitation of a directory tree: a blob ``a`` and a blob ``a/b`` cannot both exist; writing the second raises
  :class:`StorageError` saying so (object stores allow it; the backends never need it).
- ``head`` gives each blob's version as its etag: device, inode, size and modification time (in nanoseconds, set
  by ``put`` from the clock just before the blob is linked in, so no two writes of a name share it even where the
  kernel's own file clock is coarse). Every put makes a new file, so every put changes it; ``set_metadata`` does
  not. A filesystem that *stores* coarse times (whole seconds: ext4 with 128-byte inodes, ext3, HFS+; FAT) cuts
  that stamp, and hands a freed inode out again, so a name deleted and written again within the second could repeat
  a version: ``put`` never stamps a whole millisecond, and a blob whose stored time is one gets no etag (``None``;
  a garbage collector then deletes it plainly, see :mod:`statebackend.kit.gc`).
  :meth:`FileBlobStore.delete_if_unchanged` is safe against a concurrent rewrite (see there).
- Thread-safe and multi-process-safe without locks: every visible change is one ``rename``/``link``/``unlink``.
  The one exception is :meth:`FileBlobStore.put_if` (a compare-and-swap): the version check and the rename hold an
  exclusive ``flock`` on ``<dir>/.statebackend~lock.<file name>`` (across threads and processes of one machine, and
  of several on a filesystem whose locks span them); plain ``put`` and ``delete`` of the same name take no lock, so
  a name is either written by ``put_if`` only or never by it. On a filesystem that stores coarse times, ``put_if``
  versions fall back to device, inode, size and the stored time (the lock makes the check and the write one step;
  only an inode reused within the same second could repeat a version).
- Every ``OSError`` other than not-found is translated to :class:`StorageError` naming the path and the store.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, ClassVar
from urllib.parse import unquote, urlsplit

import attrs

from statebackend.blobstores.base import AbandonedUpload, BlobInfo, BlobStore, check_blob_name, check_metadata
from statebackend.errors import AlreadyExistsError, ConfigError, NotFoundError, PreconditionFailedError, StorageError
from statebackend.fsutil import atomic_write, fsync_dir
from statebackend.options import OptionSpec, default_of, parse_bool

__all__ = ["RESERVED_PREFIX", "FileBlobStore"]

#: segment prefix reserved for the store's own temp and metadata files; never a blob name, never listed
RESERVED_PREFIX = ".statebackend~"
_TEMP_PREFIX = RESERVED_PREFIX + "tmp."
_LOCK_PREFIX = RESERVED_PREFIX + "lock."
_META_DIR = RESERVED_PREFIX + "meta"
_COPY_BUFFER = 1024 * 1024
# a concurrent delete may prune the directory a put just created; the put then recreates it and tries again
_MAX_DIRECTORY_RACES = 100
_NOT_FOUND_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR}
#: a stored mtime that is a multiple of this was cut by the filesystem (``put`` never stamps one): no version
_COARSE_TIME_NS = 1_000_000


def _absolute_path(root: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.fspath(root))


@attrs.define(eq=False)
class FileBlobStore(BlobStore):
    """Blobs as files under ``root``. With ``create=False`` (``blob.store.create.if.missing=false``) a missing root
    is an error instead of being made: an unmounted share is not silently replaced by an empty local directory.

    No I/O happens here; the root is checked (or created) on first use.
    """

    supports_conditional_delete = True
    supports_conditional_put = True
    options: ClassVar[Mapping[str, OptionSpec]] = {
        "create.if.missing": OptionSpec(
            parse_bool(), True, "create the directory when missing (false: a missing directory is an error)"
        ),
    }

    root: str = attrs.field(converter=_absolute_path)
    create: bool = attrs.field(default=default_of(options, "create.if.missing"), kw_only=True)
    url: str = attrs.field(init=False)
    _root_ready: bool = attrs.field(init=False, default=False, repr=False)
    _root_lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    @url.default
    def _url_from_root(self) -> str:
        return "file://" + self.root.replace(os.sep, "/")

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, Any]) -> FileBlobStore:
        """Open ``file:///absolute/path``. ``options`` parsed against :attr:`options`: ``create.if.missing``
        (default true) makes the root if it is missing."""
        parts = urlsplit(url)
        if parts.scheme != "file":
            raise ConfigError(f"blob.store.url {url!r} is not a file:// URL")
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"blob.store.url {url!r} names host {parts.netloc!r}; a file:// URL needs an absolute path, "
                f"e.g. file:///var/lib/statebackend (three slashes)"
            )
        path = unquote(parts.path)
        if not path or not os.path.isabs(path):
            raise ConfigError(
                f"blob.store.url {url!r} has no absolute path; use e.g. file:///var/lib/statebackend (three slashes)"
            )
        return cls(path, create=options["create.if.missing"])

    # -- the contract ---------------------------------------------------------------------------------------------

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        view = memoryview(data)

        def write(out: BinaryIO) -> None:
            out.write(view)

        self._write(name, write, create_only=create_only, metadata=metadata)

    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        """The version check and the rename under an exclusive lock of the name (module docstring)."""
        path = self._blob_path(name)
        directory = os.path.dirname(path)
        view = memoryview(data)

        def write(out: BinaryIO) -> None:
            out.write(view)

        for _ in range(_MAX_DIRECTORY_RACES):
            self._make_directories(name, directory)
            lock_path = os.path.join(directory, _LOCK_PREFIX + os.path.basename(path))
            try:
                lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            except FileNotFoundError:
                continue  # a concurrent delete pruned the directory we just made
            except OSError as exc:
                raise self._storage_error("lock", lock_path, exc) from exc
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
                current = self._locked_version(path)
                if current != version:
                    found = "absent" if current is None else f"version {current}"
                    raise PreconditionFailedError(
                        f"blob {name!r} in {self.describe()} is {found}, not "
                        f"{'absent' if version is None else 'version ' + version}: not written"
                    )
                self._write(name, write, create_only=version is None, metadata=None)
                written = self._locked_version(path)
                if written is None:
                    raise StorageError(f"blob {name!r} in {self.describe()} vanished right after its write")
                return written
            except OSError as exc:
                if isinstance(exc, (StorageError, AlreadyExistsError, NotFoundError)):
                    raise
                raise self._storage_error("lock", lock_path, exc) from exc
            finally:
                os.close(lock_fd)  # releases the lock
        raise StorageError(f"directory {directory!r} of {self.describe()} kept disappearing while writing {name!r}")

    def get_versioned(self, name: str) -> tuple[bytes, str]:
        """The bytes and the version of the one file opened (one consistent version even if replaced meanwhile)."""
        with self._open_blob(name) as f:
            info = os.fstat(f.fileno())
            data = f.read()
        return data, _put_if_version(info)

    def _locked_version(self, path: str) -> str | None:
        try:
            info = os.lstat(path)
        except OSError as exc:
            if exc.errno in _NOT_FOUND_ERRNOS:
                return None
            raise self._storage_error("inspect", path, exc) from exc
        return None if stat.S_ISDIR(info.st_mode) else _put_if_version(info)

    def put_file(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        create_only: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Copy a local file in, streaming (never the whole file in memory)."""
        check_blob_name(name)
        source_path = os.fspath(path)
        try:
            source = open(source_path, "rb")  # noqa: SIM115 - closed below; opened first so a bad path writes nothing
        except FileNotFoundError as exc:
            raise NotFoundError(f"local file {source_path!r} to upload as blob {name!r} does not exist") from exc
        except OSError as exc:
            raise StorageError(f"cannot read local file {source_path!r} to upload as blob {name!r}: {exc}") from exc
        with source:

            def write(out: BinaryIO) -> None:
                shutil.copyfileobj(source, out, _COPY_BUFFER)

            self._write(name, write, create_only=create_only, metadata=metadata)

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        with self._open_blob(name) as f:
            size = os.fstat(f.fileno()).st_size
            first, last = _clamp_range(size, start, end)
            if first >= last:
                return b""
            f.seek(first)
            return f.read(last - first)

    def get_into(self, name: str, out: BinaryIO) -> int:
        """Stream the blob into ``out`` (one open file, so one consistent version even if replaced meanwhile)."""
        with self._open_blob(name) as f:
            return _copy(f, out)

    def get_file(self, name: str, path: str | os.PathLike[str]) -> int:
        """Copy the blob to ``path`` atomically: the blob is opened first, so an absent blob leaves ``path`` as it
        was; the copy goes to a temp file next to ``path`` that is fsynced and renamed over it."""
        target = _absolute_path(path)
        directory = os.path.dirname(target)
        with self._open_blob(name) as source:
            try:
                with atomic_write(target, prefix=_TEMP_PREFIX, sync_directory=True) as out:
                    size = _copy(source, out)
            except OSError as exc:
                raise StorageError(
                    f"cannot write blob {name!r} of {self.describe()} to local file {target!r}: {exc}; "
                    f"check that the directory {directory!r} exists and is writable"
                ) from exc
        return size

    def iter_bytes(self, name: str, chunk_size: int = _COPY_BUFFER) -> Iterator[bytes]:
        """Stream the blob from one open file (one consistent version even if replaced meanwhile)."""
        if chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
        with self._open_blob(name) as f:
            while chunk := f.read(chunk_size):
                yield chunk

    def delete(self, name: str) -> None:
        path = self._blob_path(name)
        try:
            info = os.lstat(path)
        except OSError as exc:
            if exc.errno in _NOT_FOUND_ERRNOS:
                return
            raise self._storage_error("inspect", path, exc) from exc
        if stat.S_ISDIR(info.st_mode):
            return  # a directory of other blobs, not a blob of this name
        try:
            os.unlink(path)
        except FileNotFoundError:
            return  # a concurrent delete won; still success
        except OSError as exc:
            raise self._storage_error("delete", path, exc) from exc
        self._remove_metadata(name, info.st_ino)
        directory = os.path.dirname(path)
        self._fsync_directory(directory)
        self._prune_empty_directories(directory)

    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        """Delete each blob whose version (:func:`_version`, the etag of ``head``) is still the one given; return
        the names kept because they were written since. Every name is checked first.

        Why no concurrent rewrite is lost: a ``put`` never changes a file, it renames a new one onto the name. So
        the version is checked on the file this call *holds*, not on a path that may change under it: after a
        first ``lstat`` (a different version: kept, nothing touched; the usual case when a writer rewrote it), the
        file is renamed to a private temp name in its directory (one atomic step: whatever version is at the name
        then is taken, and the name is free for any writer), and that file's version is checked. The expected
        version is then deleted: a rewrite landing after the rename lands on the free name and stays. A different
        version (written between the ``lstat`` and the rename) is linked back create-only: a ``link`` onto a name
        that a still newer write took meanwhile fails, and that newer version stays, as any rewrite replaces an
        older one. Between the rename and the link back (a few system calls, only when a rewrite raced the check
        by microseconds) a reader finds the name absent (``get``/``head``: :class:`NotFoundError`, ``list``
        without it) and a create-only write may take it. The one way to lose that version is a process that dies
        exactly there (or a ``link`` refused for another reason than a taken name, reported as a
        :class:`StorageError`): it is left in a temp file, which a collection of :meth:`abandoned_uploads` removes."""
        paths = {name: self._blob_path(name) for name in versions}
        kept = {name for name, version in versions.items() if not self._delete_version(name, paths[name], version)}
        return frozenset(kept)

    def _delete_version(self, name: str, path: str, version: str) -> bool:
        """Delete ``path`` if it holds ``version``: True when deleted or absent, False when kept (another version)."""
        try:
            info = os.lstat(path)
        except OSError as exc:
            if exc.errno in _NOT_FOUND_ERRNOS:
                return True
            raise self._storage_error("inspect", path, exc) from exc
        if stat.S_ISDIR(info.st_mode):
            return True  # a directory of other blobs: no blob of this name
        if _version(info) != version:
            return False  # another version (or one that cannot be told apart: never deleted on condition)
        directory = os.path.dirname(path)
        taken_path = os.path.join(directory, f"{_TEMP_PREFIX}{secrets.token_hex(8)}")
        try:
            os.rename(path, taken_path)
        except FileNotFoundError:
            return True  # a concurrent delete won; still success
        except OSError as exc:
            raise self._storage_error("delete", path, exc) from exc
        try:
            taken = os.lstat(taken_path)
            if _version(taken) != version:
                self._put_back(name, taken_path, path, taken.st_ino)
                return False
            os.unlink(taken_path)
        except OSError as exc:
            raise self._storage_error("delete", taken_path, exc) from exc
        self._remove_metadata(name, taken.st_ino)
        self._fsync_directory(directory)
        self._prune_empty_directories(directory)
        return True

    def _put_back(self, name: str, taken_path: str, path: str, inode: int) -> None:
        """Link a version taken by mistake back at its name, create-only (a newer write there wins), then drop the
        temp name."""
        try:
            os.link(taken_path, path)
        except FileExistsError:
            self._remove_metadata(name, inode)  # superseded by the newer write, as a replace would have
        os.unlink(taken_path)
        self._fsync_directory(os.path.dirname(path))

    def _list(self, prefix: str) -> Iterator[str]:
        """Yield blob names starting with ``prefix``, sorted; only directories that can match are read (the raw
        listing under the base's template, which checks the prefix, the order and every name)."""
        root = self._ready_root()
        directory, slash, partial = prefix.rpartition("/")
        if "\x00" in partial or "\\" in partial:
            return  # no valid name contains these
        if slash:
            try:
                check_blob_name(directory)
            except ConfigError:
                return  # no valid name lies under it
            if _is_reserved(directory):
                return
        base = os.path.join(root, *directory.split("/")) if directory else root
        yield from self._walk(base, directory + "/" if directory else "", partial)

    def head(self, name: str) -> BlobInfo:
        path = self._blob_path(name)
        # metadata is found by inode; if the blob was replaced between the two stats, read again
        for _ in range(_MAX_DIRECTORY_RACES):
            before = self._stat_blob(name, path)
            metadata = self._read_metadata(name, before.st_ino)
            after = self._stat_blob(name, path)
            if _same_file(before, after):
                return BlobInfo(name=name, size=after.st_size, metadata=metadata, etag=_version(after))
        raise StorageError(f"blob {name!r} in {self.describe()} kept changing while being read; try again")

    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        """Replace the blob's metadata without rewriting its bytes (one atomic rename of the metadata file)."""
        path = self._blob_path(name)
        checked = _check_metadata(metadata)
        info = self._stat_blob(name, path)
        if checked:
            self._write_metadata(name, info.st_ino, checked)
        else:
            self._remove_metadata(name, info.st_ino)

    def exists(self, name: str) -> bool:
        path = self._blob_path(name)
        try:
            self._stat_blob(name, path)
        except NotFoundError:
            return False
        return True

    def create_root(self) -> None:
        """Make the root directory (and its parents); success if it exists. For ``create_resources``."""
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise self._storage_error("create the root directory", self.root, exc) from exc
        self._root_ready = True

    def create_resources(self) -> None:
        """What a backend admin's ``create_resources`` asks of a blob store: the root directory."""
        self.create_root()

    def validate(self) -> None:
        """The root must be a writable directory (or creatable when the store creates it)."""
        self._ready_root()
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StorageError(f"the root directory {self.root!r} of {self.describe()} is not writable by this user")

    # -- helpers ------------------------------------------------------------------------------------------------

    def _ready_root(self) -> str:
        if self._root_ready:
            return self.root
        with self._root_lock:
            if self._root_ready:
                return self.root
            if self.create:
                self.create_root()
            elif not os.path.isdir(self.root):
                raise StorageError(
                    f"the root directory {self.root!r} of {self.describe()} does not exist; create it (or mount it), "
                    f"or set blob.store.create.if.missing=true to let the store create it, or run the backend's "
                    f"create_resources"
                )
            self._root_ready = True
        return self.root

    def _blob_path(self, name: str) -> str:
        check_blob_name(name)
        if _is_reserved(name):
            raise ConfigError(
                f"blob name {name!r} has a segment starting with {RESERVED_PREFIX!r}, which the file:// blob store "
                f"reserves for its temp and metadata files; choose another name"
            )
        return os.path.join(self._ready_root(), *name.split("/"))

    def _write(
        self,
        name: str,
        write: Callable[[BinaryIO], None],
        *,
        create_only: bool,
        metadata: Mapping[str, str] | None,
    ) -> None:
        path = self._blob_path(name)
        checked = _check_metadata(metadata)
        directory = os.path.dirname(path)
        fd, temp = self._create_temp(name, directory)
        try:
            with os.fdopen(fd, "wb") as out:
                write(out)
                out.flush()
                stamp = time.time_ns()  # the version's mtime: fine-grained, whatever the filesystem's own clock
                if stamp % _COARSE_TIME_NS == 0:
                    stamp += 1  # never a whole millisecond: a stored time that is one was cut by the filesystem
                os.utime(out.fileno(), ns=(stamp, stamp))
                os.fsync(out.fileno())
                inode = os.fstat(out.fileno()).st_ino
            # the metadata must be durable before the blob is visible, so they appear together
            if checked:
                self._write_metadata(name, inode, checked)
            else:
                self._remove_metadata(name, inode)  # a stale file left by an earlier blob whose inode was reused
            if create_only:
                self._link_new(name, temp, path, inode)
                _unlink_quietly(temp)
            else:
                old_inode = self._current_inode(path)
                self._replace(name, temp, path)
                if old_inode is not None:
                    self._remove_metadata(name, old_inode)
            self._fsync_directory(directory)
        except BaseException as exc:
            _unlink_quietly(temp)
            if isinstance(exc, OSError) and not isinstance(exc, (StorageError, AlreadyExistsError, NotFoundError)):
                raise self._storage_error("write", temp, exc) from exc
            raise

    def _create_temp(self, name: str, directory: str) -> tuple[int, str]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        for _ in range(_MAX_DIRECTORY_RACES):
            self._make_directories(name, directory)
            temp = os.path.join(directory, f"{_TEMP_PREFIX}{secrets.token_hex(8)}")
            try:
                return os.open(temp, flags, 0o666), temp  # 0o666 & ~umask, like any file the user writes
            except FileNotFoundError:
                continue  # a concurrent delete pruned the directory we just made
            except OSError as exc:
                raise self._storage_error("create a temp file", temp, exc) from exc
        raise StorageError(f"directory {directory!r} of {self.describe()} kept disappearing while writing {name!r}")

    def _make_directories(self, name: str, directory: str) -> None:
        missing: list[str] = []
        current = directory
        while current != self.root and not os.path.isdir(current):
            missing.append(current)
            current = os.path.dirname(current)
        for made in reversed(missing):
            try:
                os.mkdir(made)
            except FileNotFoundError:
                return  # a concurrent delete pruned a parent; creating the temp file fails and the caller retries
            except FileExistsError:
                if not os.path.isdir(made):
                    raise StorageError(
                        f"cannot write blob {name!r} in {self.describe()}: {made!r} is a blob, and the file:// store "
                        f"cannot hold a blob and names under it ('a' and 'a/b') at once"
                    ) from None
                continue
            except OSError as exc:
                if exc.errno == errno.ENOTDIR:
                    raise StorageError(
                        f"cannot write blob {name!r} in {self.describe()}: a parent of {made!r} is a blob, and the "
                        f"file:// store cannot hold a blob and names under it ('a' and 'a/b') at once"
                    ) from exc
                raise self._storage_error("create directory", made, exc) from exc
            self._fsync_directory(os.path.dirname(made))

    def _link_new(self, name: str, temp: str, path: str, inode: int) -> None:
        try:
            os.link(temp, path)
        except FileExistsError:
            self._remove_metadata(name, inode)
            if os.path.isdir(path):
                raise self._name_is_directory(name) from None
            raise AlreadyExistsError(f"blob {name!r} already exists in {self.describe()}") from None
        except OSError as exc:
            self._remove_metadata(name, inode)
            if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise StorageError(
                    f"create-only write of blob {name!r} in {self.describe()} needs hard links, which the filesystem "
                    f"of {path!r} refused ({exc.strerror}); put the store on a local POSIX filesystem"
                ) from exc
            raise self._storage_error("create", path, exc) from exc

    def _replace(self, name: str, temp: str, path: str) -> None:
        try:
            os.replace(temp, path)
        except IsADirectoryError:
            raise self._name_is_directory(name) from None
        except OSError as exc:
            raise self._storage_error("replace", path, exc) from exc

    def _name_is_directory(self, name: str) -> StorageError:
        return StorageError(
            f"cannot write blob {name!r} in {self.describe()}: blobs named {name + '/'!r}... exist, and the file:// "
            f"store cannot hold a blob and names under it ('a' and 'a/b') at once"
        )

    def _current_inode(self, path: str) -> int | None:
        try:
            return os.lstat(path).st_ino
        except OSError:
            return None  # absent, or the replace will report the problem

    def _stat_blob(self, name: str, path: str) -> os.stat_result:
        try:
            info = os.stat(path)
        except OSError as exc:
            if exc.errno in _NOT_FOUND_ERRNOS:
                raise NotFoundError(f"blob {name!r} not found in {self.describe()}") from None
            raise self._storage_error("inspect", path, exc) from exc
        if not stat.S_ISREG(info.st_mode):
            raise NotFoundError(f"blob {name!r} not found in {self.describe()} (it is a directory of other blobs)")
        return info

    def _open_blob(self, name: str) -> BinaryIO:
        path = self._blob_path(name)
        try:
            f = open(path, "rb")  # noqa: SIM115 - the caller closes it
        except OSError as exc:
            if exc.errno in _NOT_FOUND_ERRNOS:
                raise NotFoundError(f"blob {name!r} not found in {self.describe()}") from None
            raise self._storage_error("read", path, exc) from exc
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            f.close()
            raise NotFoundError(f"blob {name!r} not found in {self.describe()} (it is a directory of other blobs)")
        return f

    def _metadata_path(self, name: str, inode: int) -> str:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
        return os.path.join(self.root, _META_DIR, digest[:2], f"{digest}.{inode}.json")

    def _read_metadata(self, name: str, inode: int) -> dict[str, str]:
        path = self._metadata_path(name, inode)
        try:
            with open(path, "rb") as f:
                document = json.loads(f.read())
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise self._storage_error("read metadata", path, exc) from exc
        except ValueError as exc:
            raise StorageError(f"metadata file {path!r} of blob {name!r} in {self.describe()} is not JSON") from exc
        return dict(document["metadata"])

    def _write_metadata(self, name: str, inode: int, metadata: dict[str, str]) -> None:
        path = self._metadata_path(name, inode)
        directory = os.path.dirname(path)
        body = json.dumps({"name": name, "metadata": metadata}, sort_keys=True).encode("utf-8", "surrogatepass")
        try:
            os.makedirs(directory, exist_ok=True)
            with atomic_write(path, prefix=_TEMP_PREFIX) as out:
                out.write(body)
        except OSError as exc:
            raise self._storage_error("write metadata", path, exc) from exc
        self._fsync_directory(directory)

    def _remove_metadata(self, name: str, inode: int) -> None:
        path = self._metadata_path(name, inode)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._storage_error("delete metadata", path, exc) from exc

    def _prune_empty_directories(self, directory: str) -> None:
        # best effort: a directory that is not empty (or already gone) stops the climb
        while directory != self.root and directory.startswith(self.root):
            try:
                os.rmdir(directory)
            except OSError:
                return
            directory = os.path.dirname(directory)

    def abandoned_uploads(self, prefix: str = "") -> builtins.list[AbandonedUpload]:
        """Temp files (``.statebackend~tmp.*``) under ``prefix`` left by writers that crashed; a write in progress
        shows here too, young: a caller removes only those older than its grace period."""
        root = self._ready_root()
        directory = prefix.rpartition("/")[0]
        base = os.path.join(root, *directory.split("/")) if directory else root
        now = time.time()
        found: builtins.list[AbandonedUpload] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(RESERVED_PREFIX))
            relative = os.path.relpath(dirpath, root).replace(os.sep, "/")
            relative = "" if relative == "." else relative + "/"
            for filename in sorted(filenames):
                name = relative + filename
                if not filename.startswith(_TEMP_PREFIX) or not name.startswith(prefix):
                    continue
                try:
                    info = os.stat(os.path.join(dirpath, filename))
                except FileNotFoundError:
                    continue  # finished or removed meanwhile
                found.append(
                    AbandonedUpload(
                        kind="temp file",
                        name=name,
                        age_s=max(0.0, now - info.st_mtime),
                        size=info.st_size,
                        handle=os.path.join(dirpath, filename),
                    )
                )
        return found

    def remove_abandoned_upload(self, upload: AbandonedUpload) -> None:
        root = self._ready_root()
        path = os.path.realpath(upload.handle)
        if os.path.commonpath([path, os.path.realpath(root)]) != os.path.realpath(root) or not os.path.basename(
            path
        ).startswith(_TEMP_PREFIX):
            raise StorageError(f"{upload.handle!r} is not a temp file of {self.describe()}; not removed")
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._storage_error("delete", path, exc) from exc

    def _walk(self, directory: str, name_prefix: str, partial: str) -> Iterator[str]:
        try:
            with os.scandir(directory) as it:
                entries = [e for e in it if e.name.startswith(partial) and not e.name.startswith(RESERVED_PREFIX)]
        except (FileNotFoundError, NotADirectoryError):
            return  # nothing there, or removed by a concurrent delete
        except OSError as exc:
            raise self._storage_error("list", directory, exc) from exc
        # a directory sorts as "name/" so that the depth-first walk yields names in plain string order
        keyed: list[tuple[str, os.DirEntry[str], bool]] = []
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
                is_file = not is_dir and entry.is_file()
            except OSError:
                continue
            if is_dir:
                keyed.append((entry.name + "/", entry, True))
            elif is_file:
                keyed.append((entry.name, entry, False))
        keyed.sort(key=lambda item: item[0])
        for _, entry, is_dir in keyed:
            if is_dir:
                yield from self._walk(entry.path, name_prefix + entry.name + "/", "")
            else:
                yield name_prefix + entry.name

    def _fsync_directory(self, directory: str) -> None:
        try:
            fsync_dir(directory)
        except OSError as exc:
            raise self._storage_error("sync directory", directory, exc) from exc

    def _storage_error(self, action: str, path: str, exc: OSError) -> StorageError:
        reason = exc.strerror or str(exc)
        return StorageError(
            f"cannot {action} {path!r} in {self.describe()}: {reason}; check that the directory exists and is writable"
        )


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _copy(source: BinaryIO, target: BinaryIO) -> int:
    total = 0
    while chunk := source.read(_COPY_BUFFER):
        target.write(chunk)
        total += len(chunk)
    return total


def _clamp_range(size: int, start: int | None, end: int | None) -> tuple[int, int]:
    if (start is not None and start < 0) or (end is not None and end < 0):
        raise ConfigError(f"byte range [{start}, {end}) must not be negative")
    first = 0 if start is None else min(start, size)
    last = size if end is None else min(end, size)
    return first, max(first, last)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


def _version(info: os.stat_result) -> str | None:
    """A blob file's version (its etag): a put makes a new file with a new inode and a fresh nanosecond mtime; a
    rename keeps all four. ``None`` when the stored mtime is a whole millisecond, which ``put`` never stamps: the
    filesystem keeps coarse times (or the blob was written otherwise), and with a reused inode the four could repeat
    an earlier version of the name."""
    if info.st_mtime_ns % _COARSE_TIME_NS == 0:
        return None
    return f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"


def _put_if_version(info: os.stat_result) -> str:
    """The version :meth:`FileBlobStore.put_if` compares: :func:`_version`, or on a filesystem that keeps coarse
    times the same four fields as they are (the lock makes check and write one step)."""
    return _version(info) or f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"


def _is_reserved(name: str) -> bool:
    return any(segment.startswith(RESERVED_PREFIX) for segment in name.split("/"))


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return check_metadata(metadata)

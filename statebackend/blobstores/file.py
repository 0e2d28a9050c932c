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
import fcntl
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO, ClassVar
from urllib.parse import unquote, urlsplit

import attrs

from statebackend.blobstores.base import AbandonedUpload, BlobInfo, check_blob_name, check_metadata
from statebackend.blobstores.file_layout import (
    COPY_BUFFER,
    LOCK_PREFIX,
    MAX_DIRECTORY_RACES,
    NOT_FOUND_ERRNOS,
    RESERVED_PREFIX,
    TEMP_PREFIX,
    absolute_path,
    blob_version,
    clamp_range,
    copy_all,
    is_reserved,
    put_if_version,
    same_file,
)
from statebackend.blobstores.file_writes import FileWrites
from statebackend.errors import AlreadyExistsError, ConfigError, NotFoundError, PreconditionFailedError, StorageError
from statebackend.fsutil import atomic_write
from statebackend.options import OptionSpec, default_of, parse_bool

__all__ = ["RESERVED_PREFIX", "FileBlobStore"]


@attrs.define(eq=False)
class FileBlobStore(FileWrites):
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

    root: str = attrs.field(converter=absolute_path)
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

        for _ in range(MAX_DIRECTORY_RACES):
            self._make_directories(name, directory)
            lock_path = os.path.join(directory, LOCK_PREFIX + os.path.basename(path))
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
        return data, put_if_version(info)

    def _locked_version(self, path: str) -> str | None:
        try:
            info = os.lstat(path)
        except OSError as exc:
            if exc.errno in NOT_FOUND_ERRNOS:
                return None
            raise self._storage_error("inspect", path, exc) from exc
        return None if stat.S_ISDIR(info.st_mode) else put_if_version(info)

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
                shutil.copyfileobj(source, out, COPY_BUFFER)

            self._write(name, write, create_only=create_only, metadata=metadata)

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        with self._open_blob(name) as f:
            size = os.fstat(f.fileno()).st_size
            first, last = clamp_range(size, start, end)
            if first >= last:
                return b""
            f.seek(first)
            return f.read(last - first)

    def get_into(self, name: str, out: BinaryIO) -> int:
        """Stream the blob into ``out`` (one open file, so one consistent version even if replaced meanwhile)."""
        with self._open_blob(name) as f:
            return copy_all(f, out)

    def get_file(self, name: str, path: str | os.PathLike[str]) -> int:
        """Copy the blob to ``path`` atomically: the blob is opened first, so an absent blob leaves ``path`` as it
        was; the copy goes to a temp file next to ``path`` that is fsynced and renamed over it."""
        target = absolute_path(path)
        directory = os.path.dirname(target)
        with self._open_blob(name) as source:
            try:
                with atomic_write(target, prefix=TEMP_PREFIX, sync_directory=True) as out:
                    size = copy_all(source, out)
            except OSError as exc:
                raise StorageError(
                    f"cannot write blob {name!r} of {self.describe()} to local file {target!r}: {exc}; "
                    f"check that the directory {directory!r} exists and is writable"
                ) from exc
        return size

    def iter_bytes(self, name: str, chunk_size: int = COPY_BUFFER) -> Iterator[bytes]:
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
            if exc.errno in NOT_FOUND_ERRNOS:
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
        """Delete each blob whose version (:func:`blob_version`, the etag of ``head``) is still the one given; return
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
            if exc.errno in NOT_FOUND_ERRNOS:
                return True
            raise self._storage_error("inspect", path, exc) from exc
        if stat.S_ISDIR(info.st_mode):
            return True  # a directory of other blobs: no blob of this name
        if blob_version(info) != version:
            return False  # another version (or one that cannot be told apart: never deleted on condition)
        directory = os.path.dirname(path)
        taken_path = os.path.join(directory, f"{TEMP_PREFIX}{secrets.token_hex(8)}")
        try:
            os.rename(path, taken_path)
        except FileNotFoundError:
            return True  # a concurrent delete won; still success
        except OSError as exc:
            raise self._storage_error("delete", path, exc) from exc
        try:
            taken = os.lstat(taken_path)
            if blob_version(taken) != version:
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
            if is_reserved(directory):
                return
        base = os.path.join(root, *directory.split("/")) if directory else root
        yield from self._walk(base, directory + "/" if directory else "", partial)

    def head(self, name: str) -> BlobInfo:
        path = self._blob_path(name)
        # metadata is found by inode; if the blob was replaced between the two stats, read again
        for _ in range(MAX_DIRECTORY_RACES):
            before = self._stat_blob(name, path)
            metadata = self._read_metadata(name, before.st_ino)
            after = self._stat_blob(name, path)
            if same_file(before, after):
                return BlobInfo(name=name, size=after.st_size, metadata=metadata, etag=blob_version(after))
        raise StorageError(f"blob {name!r} in {self.describe()} kept changing while being read; try again")

    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        """Replace the blob's metadata without rewriting its bytes (one atomic rename of the metadata file)."""
        path = self._blob_path(name)
        checked = check_metadata(metadata)
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
        if is_reserved(name):
            raise ConfigError(
                f"blob name {name!r} has a segment starting with {RESERVED_PREFIX!r}, which the file:// blob store "
                f"reserves for its temp and metadata files; choose another name"
            )
        return os.path.join(self._ready_root(), *name.split("/"))

    def _stat_blob(self, name: str, path: str) -> os.stat_result:
        try:
            info = os.stat(path)
        except OSError as exc:
            if exc.errno in NOT_FOUND_ERRNOS:
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
            if exc.errno in NOT_FOUND_ERRNOS:
                raise NotFoundError(f"blob {name!r} not found in {self.describe()}") from None
            raise self._storage_error("read", path, exc) from exc
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            f.close()
            raise NotFoundError(f"blob {name!r} not found in {self.describe()} (it is a directory of other blobs)")
        return f

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
                if not filename.startswith(TEMP_PREFIX) or not name.startswith(prefix):
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
        ).startswith(TEMP_PREFIX):
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

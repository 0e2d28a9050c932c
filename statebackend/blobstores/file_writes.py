"""The write path of the ``file://`` store (:mod:`statebackend.blobstores.file`): a blob written to a temp file in its
directory, stamped, fsynced and linked (create-only) or renamed onto its name, with its metadata file written first
so both appear together; the directories it needs made against a concurrent delete pruning them; the metadata files
keyed by inode; and the ``OSError`` translation every operation uses. :class:`FileWrites` is a base of
:class:`~statebackend.blobstores.file.FileBlobStore`.
"""

from __future__ import annotations

import abc
import errno
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import BinaryIO

from statebackend.blobstores.base import BlobStore, check_metadata
from statebackend.blobstores.file_layout import (
    COARSE_TIME_NS,
    MAX_DIRECTORY_RACES,
    META_DIR,
    TEMP_PREFIX,
    unlink_quietly,
)
from statebackend.errors import AlreadyExistsError, NotFoundError, StorageError
from statebackend.fsutil import atomic_write, fsync_dir

__all__ = ["FileWrites"]


class FileWrites(BlobStore):
    """The atomic writes and metadata files of :class:`~statebackend.blobstores.file.FileBlobStore`."""

    #: the root directory, absolute
    root: str

    @abc.abstractmethod
    def _blob_path(self, name: str) -> str:
        """The file of blob ``name`` under the (ready) root; a name the store refuses is a :class:`ConfigError`."""

    def _write(
        self,
        name: str,
        write: Callable[[BinaryIO], None],
        *,
        create_only: bool,
        metadata: Mapping[str, str] | None,
    ) -> None:
        path = self._blob_path(name)
        checked = check_metadata(metadata)
        directory = os.path.dirname(path)
        fd, temp = self._create_temp(name, directory)
        try:
            with os.fdopen(fd, "wb") as out:
                write(out)
                out.flush()
                stamp = time.time_ns()  # the version's mtime: fine-grained, whatever the filesystem's own clock
                if stamp % COARSE_TIME_NS == 0:
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
                unlink_quietly(temp)
            else:
                old_inode = self._current_inode(path)
                self._replace(name, temp, path)
                if old_inode is not None:
                    self._remove_metadata(name, old_inode)
            self._fsync_directory(directory)
        except BaseException as exc:
            unlink_quietly(temp)
            if isinstance(exc, OSError) and not isinstance(exc, (StorageError, AlreadyExistsError, NotFoundError)):
                raise self._storage_error("write", temp, exc) from exc
            raise

    def _create_temp(self, name: str, directory: str) -> tuple[int, str]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        for _ in range(MAX_DIRECTORY_RACES):
            self._make_directories(name, directory)
            temp = os.path.join(directory, f"{TEMP_PREFIX}{secrets.token_hex(8)}")
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

    def _metadata_path(self, name: str, inode: int) -> str:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
        return os.path.join(self.root, META_DIR, digest[:2], f"{digest}.{inode}.json")

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
            with atomic_write(path, prefix=TEMP_PREFIX) as out:
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

"""Large uploads of the ``s3://`` store (:mod:`statebackend.blobstores.s3`): a multipart upload of parallel parts,
completed under the write's condition, aborted when it fails, and a completion whose reply was lost decided by what
is stored (the module docstring of :mod:`statebackend.blobstores.s3` says how); and the incomplete uploads a crashed
writer leaves, listed and removed for a garbage collection. :class:`S3Multipart` is a base of
:class:`~statebackend.blobstores.s3.S3BlobStore`.
"""

from __future__ import annotations

import builtins
import datetime
import functools
import hashlib
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from statebackend.blobstores.base import AbandonedUpload, check_blob_name, check_metadata
from statebackend.blobstores.parted import part_pool, part_ranges, sdk_boundary
from statebackend.blobstores.s3_boundary import S3Boundary, is_transient_answer
from statebackend.blobstores.s3_replies import error_code as _code
from statebackend.concurrency import run_all
from statebackend.errors import AlreadyExistsError, NotFoundError, StorageError, TransientStorageError

try:
    import botocore.exceptions as boto_errors
except ImportError as exc:  # pragma: no cover - the registry turns this into an install hint
    raise ImportError("s3:// needs boto3: pip install 'statebackend[s3]'") from exc


__all__ = ["S3Multipart"]

_log = logging.getLogger(__name__)


def _multipart_etag(part_etags: builtins.list[str]) -> str | None:
    """The ETag S3 gives a completed multipart upload of these parts (the MD5 of their MD5s, then ``-<count>``),
    or ``None`` when a part's ETag is no MD5 (a server or an encryption that computes them otherwise)."""
    digests = []
    for etag in part_etags:
        text = str(etag).strip('"')
        if not re.fullmatch(r"[0-9a-fA-F]{32}", text):
            return None
        digests.append(bytes.fromhex(text))
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


class S3Multipart(S3Boundary):
    """Multipart uploads and the abandoned ones, for :class:`~statebackend.blobstores.s3.S3BlobStore`."""

    @sdk_boundary
    def abandoned_uploads(self, prefix: str = "") -> builtins.list[AbandonedUpload]:
        """Multipart uploads under ``prefix`` that were never completed nor aborted (a writer that crashed mid
        upload); an upload in progress shows here too, young."""
        root = self._root()
        found: builtins.list[AbandonedUpload] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": root + prefix}
        now = datetime.datetime.now(datetime.UTC)
        while True:
            with self._errors(prefix or "(all)"):
                page = self._client.list_multipart_uploads(**kwargs)
            for upload in page.get("Uploads") or []:
                key, upload_id, initiated = upload.get("Key"), upload.get("UploadId"), upload.get("Initiated")
                if not isinstance(key, str) or not key.startswith(root) or not upload_id:
                    continue
                age = (now - initiated).total_seconds() if isinstance(initiated, datetime.datetime) else None
                found.append(
                    AbandonedUpload(
                        kind="multipart upload", name=key[len(root) :], age_s=age, size=None, handle=str(upload_id)
                    )
                )
            if not page.get("IsTruncated"):
                return found
            kwargs["KeyMarker"] = page.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker")

    @sdk_boundary
    def remove_abandoned_upload(self, upload: AbandonedUpload) -> None:
        with self._errors(upload.name):
            try:
                self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self._key(upload.name), UploadId=upload.handle
                )
            except boto_errors.ClientError as exc:
                if _code(exc) != "NoSuchUpload":  # aborted or completed meanwhile: nothing left to remove
                    raise

    # -- large transfers: multipart upload and parallel ranged reads ----------------------------------------------

    @sdk_boundary
    def put_file(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        create_only: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        check_blob_name(name)
        if self._put_small_file(name, path, create_only, metadata):
            return
        size = os.path.getsize(path)
        key = self._key(name)
        create_kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if metadata:
            create_kwargs["Metadata"] = check_metadata(metadata)

        def create() -> str:
            with self._errors(name):
                response = self._with_bucket(lambda: self._client.create_multipart_upload(**create_kwargs))
            if not response.get("UploadId"):
                raise self._malformed(name, "CreateMultipartUpload", "an UploadId")
            return str(response["UploadId"])

        upload_id = self._request("create_multipart_upload", create, False)
        ranges = part_ranges(size, self.part_size)

        def upload(index: int) -> dict[str, Any]:
            start, end = ranges[index]
            with open(path, "rb") as f:
                f.seek(start)
                chunk = f.read(end - start)
            with self._errors(name):
                response = self._client.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=index + 1, Body=chunk
                )
            if not response.get("ETag"):
                raise self._malformed(name, "UploadPart", "an ETag")
            return {"PartNumber": index + 1, "ETag": response["ETag"]}

        try:
            uploaded = run_all(
                part_pool(self.max_concurrency),
                [
                    functools.partial(
                        self._request,
                        "upload_part",
                        functools.partial(upload, i),
                        True,
                        sent=ranges[i][1] - ranges[i][0],
                    )
                    for i in range(len(ranges))
                ],
            )

            completions = 0
            expected_etag = _multipart_etag([part["ETag"] for part in uploaded])

            def landed() -> bool:
                """Whether the stored blob is this upload (an earlier completion whose reply was lost)."""
                return self._stored_equals_upload(name, size, path, metadata, expected_etag)

            def complete() -> None:
                nonlocal completions
                completions += 1
                kwargs: dict[str, Any] = {
                    "Bucket": self.bucket,
                    "Key": key,
                    "UploadId": upload_id,
                    "MultipartUpload": {"Parts": uploaded},
                }
                if create_only:
                    kwargs["IfNoneMatch"] = "*"
                with self._errors(name, create_only=create_only):
                    try:
                        response = self._client.complete_multipart_upload(**kwargs)
                    except boto_errors.ClientError as exc:
                        if completions == 1 or is_transient_answer(exc):
                            raise  # a first answer is the truth; a transient one is retried (then read back)
                        # an earlier completion may have landed and lost its reply: the server answers the retry
                        # NoSuchUpload, a bare 400 or 404, 412 for create-only, ...; what is stored decides
                        if self._resolve_retried_completion(name, exc, landed, create_only):
                            return
                        raise
                if not response.get("ETag"):
                    # a reply cut inside its head parses as an empty success: retry; a completed upload then answers
                    # in some way, resolved by reading back
                    raise self._malformed(name, "CompleteMultipartUpload", "an ETag")

            def own() -> bool:
                # after the last attempt failed transiently: ours is success; anything else leaves the error (other
                # bytes under a create-only name are taken; under a plain write, the transient error stands)
                if landed():
                    return True
                if create_only:
                    return False
                raise NotFoundError(f"blob {name!r}: the completion did not land")

            self._request("complete_multipart_upload", complete, False, own)
        except BaseException:
            self._abort(name, key, upload_id)
            raise

    def _resolve_retried_completion(
        self, name: str, answer: Exception, landed: Callable[[], bool], create_only: bool
    ) -> bool:
        """A retried CompleteMultipartUpload was refused (``answer``) after an earlier attempt lost its reply: True
        when the stored blob is this upload (that attempt completed it). Otherwise the refusal stands, except that
        an upload gone (``NoSuchUpload``) with another blob under the name says what happened (the answer alone
        would read "not found"). A read-back that fails leaves the outcome undecided: transient."""
        try:
            if landed():
                _log.info(
                    "%s: the completion of the multipart upload of %r had landed (its reply was lost; the retry was "
                    "answered %s); read back: the stored blob is this upload",
                    self.describe(),
                    name,
                    _code(answer) or "an error",
                )
                return True
        except NotFoundError:
            return False
        except TransientStorageError as exc:
            raise TransientStorageError(
                f"the completion of the multipart upload of {name!r} to {self.describe()} was refused after a lost "
                f"reply ({_code(answer)}) and the blob could not be read back to tell whether it landed; retry it"
            ) from exc
        if _code(answer) != "NoSuchUpload":
            return False
        if create_only:
            raise AlreadyExistsError(f"blob {name!r} already exists in {self.describe()} (other bytes)")
        raise StorageError(
            f"the multipart upload of {name!r} to {self.describe()} vanished and the stored blob is not this file "
            "(a concurrent writer, or the upload was aborted); upload it again"
        )

    def _stored_equals_upload(
        self,
        name: str,
        size: int,
        path: str | os.PathLike[str],
        metadata: Mapping[str, str] | None,
        expected_etag: str | None,
    ) -> bool:
        """Whether the stored blob is this multipart upload: its size and metadata, and its ETag equal to the one S3
        gives these parts (one HEAD), else its bytes equal to the file (read back in parts). Absent:
        :class:`NotFoundError`."""
        info = self._request("head", lambda: self.head(name), True)
        if info.size != size or dict(info.metadata) != dict(metadata or {}):
            return False
        if expected_etag is not None and info.etag is not None and info.etag.strip('"') == expected_etag:
            return True
        return self._stored_equals_file(name, size, path, metadata)

    def _abort(self, name: str, key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # noqa: BLE001 - the upload's own error matters; a leftover upload only costs storage
            _log.warning("could not abort the multipart upload of %r in %s: %s", name, self.describe(), self._safe(exc))

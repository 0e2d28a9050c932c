"""The SDK boundary of the ``s3://`` store (:mod:`statebackend.blobstores.s3`): where a blob's key is (under the
prefix, in the bucket), the bucket made on demand (``create.if.missing``), and the translation of boto3's and the
stdlib's exceptions into statebackend errors, redacted and chained to sanitized stand-ins. :class:`S3Boundary` is a
base of :class:`~statebackend.blobstores.s3.S3BlobStore`, which holds the requests themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from statebackend.blobstores.base import check_blob_name
from statebackend.blobstores.parted import PartedBlobStore
from statebackend.blobstores.s3_replies import AUTH_CODES as _AUTH_CODES
from statebackend.blobstores.s3_replies import MALFORMED_REPLY as _MALFORMED_REPLY
from statebackend.blobstores.s3_replies import NOT_FOUND_CODES as _NOT_FOUND_CODES
from statebackend.blobstores.s3_replies import TRANSIENT_BOTO as _TRANSIENT_BOTO
from statebackend.blobstores.s3_replies import TRANSIENT_CODES as _TRANSIENT_CODES
from statebackend.blobstores.s3_replies import error_code as _code
from statebackend.errors import (
    AlreadyExistsError,
    NotFoundError,
    PreconditionFailedError,
    StateBackendError,
    StorageError,
    TransientStorageError,
)
from statebackend.redact import redact, sanitized

try:
    import botocore.exceptions as boto_errors
except ImportError as exc:  # pragma: no cover - the registry turns this into an install hint
    raise ImportError("s3:// needs boto3: pip install 'statebackend[s3]'") from exc


__all__ = ["S3Boundary", "is_transient_answer"]

T = TypeVar("T")


def is_transient_answer(exc: Exception) -> bool:
    """Whether a service's error answer is one a retry may fix (throttling, 5xx): the resilience layer retries it."""
    response = getattr(exc, "response", None) or {}
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return _code(exc) in _TRANSIENT_CODES or status in {408, 429} or status >= 500


class S3Boundary(PartedBlobStore):
    """The key, bucket and error helpers of :class:`~statebackend.blobstores.s3.S3BlobStore` (set up by its
    ``__init__``)."""

    #: the bucket
    bucket: str
    #: the key prefix inside the bucket, without ``/`` at either end ("" for the whole bucket)
    prefix: str
    #: whether a write to a missing bucket creates it (``blob.store.create.if.missing``)
    create_if_missing: bool
    _client: Any
    _created_lock: threading.Lock

    def _root(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def _key(self, name: str) -> str:
        return self._root() + check_blob_name(name)

    def _with_bucket(self, write: Callable[[], T]) -> T:
        """Run a write; with ``create.if.missing`` a missing bucket is created once and the write redone."""
        try:
            return write()
        except boto_errors.ClientError as exc:
            if not (self.create_if_missing and _code(exc) == "NoSuchBucket"):
                raise
        with self._created_lock:
            self.create_resources()
        return write()

    def _missing_bucket_message(self) -> str:
        return (
            f"bucket {self.bucket!r} does not exist at {self._client.meta.endpoint_url}: create it or set "
            "blob.store.create.if.missing=true"
        )

    @contextmanager
    def _errors(self, name: str, *, create_only: bool = False, conditional: bool = False) -> Iterator[None]:
        """Translate SDK and stdlib exceptions at the boundary; the chained cause is a sanitized stand-in.
        ``conditional``: a :meth:`put_if`, whose refusals are :class:`PreconditionFailedError`."""
        try:
            yield
        except StateBackendError:
            raise
        except (boto_errors.BotoCoreError, boto_errors.ClientError) as exc:
            if conditional and isinstance(exc, boto_errors.ClientError):
                code = _code(exc)
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                if code in {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"} or status in {409, 412}:
                    raise PreconditionFailedError(
                        f"blob {name!r} in {self.describe()} is not at the version the conditional write gave "
                        f"({status} {code}): not written"
                    ) from sanitized(exc, self._secrets())
            raise self._translate(exc, name, create_only) from sanitized(exc, self._secrets())
        except _MALFORMED_REPLY as exc:
            raise TransientStorageError(
                f"the reply of {self.describe()} for {name!r} was cut short or malformed ({type(exc).__name__}: "
                f"{self._safe(exc)}); worth a retry"
            ) from sanitized(exc, self._secrets())

    def _malformed(self, name: str, operation: str, missing: str) -> TransientStorageError:
        return TransientStorageError(
            f"the {operation} reply of {self.describe()} for {name!r} lacks {missing}: it was cut or malformed; "
            "worth a retry"
        )

    def _translate(self, exc: Exception, name: str, create_only: bool) -> Exception:
        where = self.describe()
        if isinstance(exc, boto_errors.NoCredentialsError):
            return StorageError(
                f"no AWS credentials for {where}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                "blob.store.profile, or run where an instance role is available"
            )
        if isinstance(exc, _TRANSIENT_BOTO):
            return TransientStorageError(f"network error on {name!r} in {where}: {type(exc).__name__}")
        if not isinstance(exc, boto_errors.ClientError):
            return StorageError(f"{type(exc).__name__} on {name!r} in {where}: {self._safe(exc)}")
        code = _code(exc)
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if create_only and (code in {"PreconditionFailed", "ConditionalRequestConflict"} or status in {409, 412}):
            return AlreadyExistsError(f"blob {name!r} already exists in {where}")
        if code == "NoSuchBucket":
            return StorageError(self._missing_bucket_message())
        if code in _NOT_FOUND_CODES or status == 404:
            return NotFoundError(f"blob {name!r} not found in {where}")
        if code in _AUTH_CODES or status == 403:
            return StorageError(
                f"{where} refused the credentials ({code}): check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE or blob.store.profile, and the bucket policy"
            )
        if code in _TRANSIENT_CODES or status in {408, 429} or status >= 500:
            return TransientStorageError(f"{where} answered {status} {code} on {name!r}; worth a retry")
        return StorageError(f"{where} answered {status} {code} on {name!r}: {self._safe(exc)}")

    def _secrets(self) -> tuple[str, ...]:
        try:
            credentials = self._client._request_signer._credentials  # private: to redact, never to show
            found = (credentials.secret_key, credentials.token) if credentials is not None else ()
        except AttributeError:
            found = ()
        return tuple(secret for secret in found if isinstance(secret, str) and secret)

    def _safe(self, exc: BaseException) -> str:
        return redact(exc, self._secrets())

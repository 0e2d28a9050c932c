"""``s3://bucket/prefix``: Amazon S3 and S3-compatible servers through boto3 (tested against moto's server).

Contract (the BlobStore contract of statebackend.blobstores.base, plus):

- Blob names live under ``prefix/`` inside ``bucket``; the store never reads or writes outside it.
- ``put(create_only=True)`` sends ``If-None-Match: *``; the answer 412 ``PreconditionFailed`` (or 409
  ``ConditionalRequestConflict``, a concurrent conditional write that won) becomes :class:`AlreadyExistsError`.
  Large files go up as a multipart upload of parallel parts whose ``CompleteMultipartUpload`` carries the same
  condition (supported by S3 since 2024 and by moto), so a large create-only upload is atomic and create-only too;
  a failed multipart upload is aborted.
- A compare-and-swap (``supports_conditional_put``): ``put_if`` is PutObject with ``If-Match: <ETag>`` (or
  ``If-None-Match: *`` to create) and returns the new ETag; 412 ``PreconditionFailed``, 409
  ``ConditionalRequestConflict`` and 404 (``If-Match`` on an absent key) are
  :class:`~statebackend.errors.PreconditionFailedError`. ``get_versioned`` is one GetObject and its ETag. S3 takes
  ``If-Match`` on PutObject since 2024, and moto's server honours it. The ETag is the MD5 of the bytes: the one user
  (the checkpoint head) writes a per-write nonce in them so no two writes share one.
- Conditional deletes (``supports_conditional_delete``; ``head`` gives the ETag): ``delete_if_unchanged`` is one
  DeleteObject with ``If-Match`` per name (S3 and moto honour it there; moto 5.2.5 ignores the per-key ETag of
  DeleteObjects). An S3 ETag is the MD5 of the bytes (``versions_follow_bytes``): the same bytes written again keep
  it, so a rewrite is told apart only when its bytes differ; a garbage collector keeps its batch wait for the
  same-bytes rewrite (statebackend.kit.gc), and writers that must be safe there write bytes of their own each time.
- ``delete_many`` is DeleteObjects; a server that refuses it (``NotImplemented``/``MethodNotAllowed``) gets one
  DeleteObject a name from then on (remembered by the store).
- An absent blob is :class:`NotFoundError`; a missing bucket, refused credentials or a bad request is
  :class:`StorageError` saying what to fix; throttling (429, 503 SlowDown), other 5xx, resets, timeouts, cut
  replies and replies missing a mandatory field are :class:`TransientStorageError`. A reply cut inside its header
  block reaches botocore as an *empty* answer, so every answer is checked: a ListObjectsV2 page must carry
  ``IsTruncated``, ``KeyCount`` (equal to its entries), ``Name`` and ``Prefix`` (equal to what was asked) and, when
  truncated, a continuation token; GetObject a Content-Length its body matches (and a Content-Range starting at the
  asked offset); HeadObject a Content-Length and an ETag; CreateMultipartUpload an UploadId; UploadPart and
  CompleteMultipartUpload an ETag. No SDK or stdlib exception reaches a caller, and errors are chained to sanitized
  stand-ins (statebackend.redact). ``head`` of a name in a missing bucket is :class:`NotFoundError` (S3 answers
  both with a bare 404); :meth:`validate` tells them apart.
- A multipart upload whose CompleteMultipartUpload reply was lost is decided by what is stored, whatever the retry
  is answered (``NoSuchUpload``, a bare 400 or 404, 412, ...; a 5xx is retried, then read back): the stored size and
  metadata this upload's, and its ETag the one S3 gives these parts (the MD5 of their MD5s) or else its bytes this
  file's, is success; otherwise the answer stands. A first completion's answer is the truth (nothing was lost).
- botocore's own retries are off: :class:`~statebackend.blobstores.resilience.ResilientBlobStore` (which ``from_url``
  returns) does retries, hedging and timeouts, per part for large transfers.
- S3 lower-cases user metadata keys. Credentials come from boto3's default chain and are never logged; a URL with
  ``user:password@`` is refused without echoing it.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

from statebackend.blobstores.base import BlobInfo, check_metadata
from statebackend.blobstores.parted import MIN_PART_SIZE, PartedBlobStore, part_pool, sdk_boundary
from statebackend.blobstores.resilience import Resilience, ResilientBlobStore
from statebackend.blobstores.s3_multipart import S3Multipart
from statebackend.blobstores.s3_replies import AUTH_CODES as _AUTH_CODES
from statebackend.blobstores.s3_replies import NOT_FOUND_CODES as _NOT_FOUND_CODES
from statebackend.blobstores.s3_replies import TRANSIENT_BOTO as _TRANSIENT_BOTO
from statebackend.blobstores.s3_replies import TRANSIENT_CODES as _TRANSIENT_CODES
from statebackend.blobstores.s3_replies import content_md5 as _content_md5
from statebackend.blobstores.s3_replies import error_code as _code
from statebackend.blobstores.s3_replies import page_problem as _page_problem
from statebackend.blobstores.s3_replies import register_credentials as _register_credentials
from statebackend.concurrency import run_all
from statebackend.errors import ConfigError, NotFoundError, StorageError, TransientStorageError
from statebackend.options import OptionSpec, default_of, parse_str
from statebackend.redact import protect_sdk_loggers, redact, sanitized, url_has_userinfo

try:
    import boto3
    import botocore.config
    import botocore.exceptions as boto_errors
except ImportError as exc:  # pragma: no cover - the registry turns this into an install hint
    raise ImportError("s3:// needs boto3: pip install 'statebackend[s3]'") from exc

__all__ = ["S3BlobStore"]

_log = logging.getLogger(__name__)

#: keys in one DeleteObjects request (S3's limit)
_DELETE_BATCH = 1000
#: how an S3-compatible server without DeleteObjects answers it
_BATCH_DELETE_REFUSED = {"NotImplemented", "MethodNotAllowed"}
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def _refuses_batch_delete(exc: Exception) -> bool:
    """Whether a DeleteObjects failed because the server does not have it (not because of the names)."""
    response = getattr(exc, "response", None) or {}
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return _code(exc) in _BATCH_DELETE_REFUSED or status in {405, 501}


class S3BlobStore(S3Multipart):
    """One bucket (and an optional prefix) of an S3 endpoint. Thread-safe (boto3 clients are)."""

    supports_conditional_put = True
    supports_conditional_delete = True
    #: the ETag of a blob is the MD5 of its bytes (of its parts' MD5s for a multipart upload): the same bytes written
    #: again keep it, so a conditional delete keeps a rewrite only when its bytes differ. A garbage collector still
    #: bounds the race for a writer that rewrites the same bytes (statebackend.kit.gc)
    versions_follow_bytes = True

    options: ClassVar[Mapping[str, OptionSpec]] = {
        **PartedBlobStore.options,
        "endpoint.url": OptionSpec(parse_str(), None, "S3 endpoint URL, for S3-compatible servers"),
        "region": OptionSpec(parse_str(), None, "S3 region"),
        "profile": OptionSpec(parse_str(), None, "AWS profile name for credentials"),
    }

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        *,
        url: str,
        part_size: int = default_of(PartedBlobStore.options, "part.size.bytes"),
        max_concurrency: int = default_of(PartedBlobStore.options, "max.concurrency"),
        create_if_missing: bool = default_of(PartedBlobStore.options, "create.if.missing"),
    ) -> None:
        if not bucket:
            raise ConfigError(f"blob.store.url {url!r} names no bucket: use s3://<bucket>/<prefix>")
        self.url = url
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = max(part_size, MIN_PART_SIZE)
        self.max_concurrency = max_concurrency
        self.create_if_missing = create_if_missing
        self._client = client
        self._resilience: Resilience | None = None
        #: names per listing request; None leaves the service's page (5,000 on Azure, 1,000 on S3). The
        #: continuation logic is the same at any size: tests set it small to list past pages cheaply.
        self.list_page_size: int | None = None
        self._created_lock = threading.Lock()
        #: the server answered DeleteObjects NotImplemented or MethodNotAllowed (an S3-compatible server without
        #: it): ``delete_many`` deletes one by one from then on
        self._batch_delete_refused = False

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, Any]) -> ResilientBlobStore:
        """Open ``s3://bucket/prefix`` wrapped in :class:`ResilientBlobStore`.

        Credentials and endpoint come from boto3's default chain (``AWS_ACCESS_KEY_ID``..., ``AWS_PROFILE`` or
        ``blob.store.profile``, shared config files, instance roles; ``AWS_ENDPOINT_URL``), with
        ``blob.store.endpoint.url`` and ``blob.store.region`` taking precedence. ``options`` as :meth:`parse_options`
        gives them; the store and its resilience layer use them as they are.
        """
        return ResilientBlobStore.wrap(cls.open_inner(url, options), options)

    @classmethod
    def open_inner(cls, url: str, options: Mapping[str, Any]) -> S3BlobStore:
        """The store without the resilience wrapper (tests, benchmarks); ``options`` raw, or parsed (used as they
        are)."""
        options = cls.parse_options(options)
        parts = urlsplit(url)
        if parts.scheme != "s3":
            raise ConfigError(f"blob.store.url {redact(url)!r} is not an s3:// URL")
        if url_has_userinfo(url) or parts.query or parts.fragment:
            raise ConfigError(
                "blob.store.url must be s3://<bucket>/<prefix> without credentials, query or fragment (not echoed "
                "here): credentials come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                "blob.store.profile"
            )
        if parts.netloc and not _BUCKET_RE.match(parts.netloc):
            raise ConfigError(
                "blob.store.url: the bucket name after s3:// is not a valid S3 bucket name (3-63 lowercase "
                "letters, digits, '.' and '-'); credentials never go in the URL"
            )
        protect_sdk_loggers()  # botocore and urllib3 log signed requests and URLs at DEBUG
        timeout_s = options["request.timeout.ms"] / 1000
        max_concurrency = options["max.concurrency"]
        endpoint = options.get("endpoint.url")
        config = botocore.config.Config(
            retries={"total_max_attempts": 1, "mode": "standard"},  # ResilientBlobStore retries
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            # room for every part request plus its hedges, so a hedge never waits for a pooled connection
            max_pool_connections=max(10, 3 * max_concurrency),
            s3={"addressing_style": "path"} if endpoint or os.environ.get("AWS_ENDPOINT_URL") else {},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            session = boto3.session.Session(profile_name=options.get("profile"), region_name=options.get("region"))
            client = session.client("s3", endpoint_url=endpoint, config=config)
        except boto_errors.ProfileNotFound as exc:
            raise ConfigError(f"blob.store.profile: AWS profile {exc.kwargs.get('profile')!r} not found") from exc
        except (boto_errors.BotoCoreError, ValueError) as exc:
            raise ConfigError(
                f"cannot configure the S3 client for {url}: {type(exc).__name__}: {redact(exc)}; check "
                "blob.store.endpoint.url, blob.store.region and blob.store.profile"
            ) from sanitized(exc)
        _register_credentials(client)
        client.meta.events.register("before-sign.s3.DeleteObjects", _content_md5)
        return cls(
            client,
            parts.netloc,
            parts.path.strip("/"),
            url=url,
            part_size=options["part.size.bytes"],
            max_concurrency=max_concurrency,
            create_if_missing=options["create.if.missing"],
        )

    def __repr__(self) -> str:
        return f"S3BlobStore(url={self.url!r}, endpoint={self._client.meta.endpoint_url!r})"

    def describe(self) -> str:
        return f"S3 blob store {self.url} (endpoint {self._client.meta.endpoint_url})"

    # -- the core -----------------------------------------------------------------------------------------------

    @sdk_boundary
    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(name), "Body": bytes(data)}
        if metadata:
            kwargs["Metadata"] = check_metadata(metadata)
        if create_only:
            kwargs["IfNoneMatch"] = "*"
        with self._errors(name, create_only=create_only):
            self._with_bucket(lambda: self._client.put_object(**kwargs))

    @sdk_boundary
    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(name), "Body": bytes(data)}
        if version is None:
            kwargs["IfNoneMatch"] = "*"
        else:
            kwargs["IfMatch"] = version
        with self._errors(name, conditional=True):
            response = self._with_bucket(lambda: self._client.put_object(**kwargs))
        etag = response.get("ETag") if isinstance(response, Mapping) else None
        if not etag:
            raise self._malformed(name, "PutObject", "an ETag")
        return str(etag)

    @sdk_boundary
    def get_versioned(self, name: str) -> tuple[bytes, str]:
        with self._errors(name):
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(name))
            promised = response.get("ContentLength")
            etag = response.get("ETag")
            if not isinstance(promised, int) or not etag:
                raise self._malformed(name, "GetObject", "Content-Length and ETag")
            data = bytes(response["Body"].read())
        if len(data) != promised:
            raise self._malformed(name, "GetObject", f"all of its {promised} bytes (got {len(data)})")
        return data, str(etag)

    @sdk_boundary
    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        key = self._key(name)
        if (start is not None and start < 0) or (end is not None and end < 0):
            raise ConfigError(f"byte range [{start}, {end}) must not be negative")
        offset = start or 0
        if end is not None and end <= offset:
            self.head(name)  # an empty range of an absent blob is still NotFoundError
            return b""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        ranged = bool(offset or end is not None)
        if ranged:
            kwargs["Range"] = f"bytes={offset}-{'' if end is None else end - 1}"
        with self._errors(name):
            try:
                response = self._client.get_object(**kwargs)
            except boto_errors.ClientError as exc:
                if _code(exc) == "InvalidRange":  # start beyond the end: the range is clamped to nothing
                    return b""
                raise
            promised = response.get("ContentLength")
            if not isinstance(promised, int):
                # without it the body is read up to the connection's end: a reply cut in its head reads as empty
                raise self._malformed(name, "GetObject", "Content-Length")
            data = bytes(response["Body"].read())
        if len(data) != promised:
            raise self._malformed(name, "GetObject", f"all of its {promised} bytes (got {len(data)})")
        if ranged:
            match = _CONTENT_RANGE_RE.match(str(response.get("ContentRange") or ""))
            if (match is None and offset > 0) or (match is not None and int(match.group(1)) != offset):
                raise self._malformed(name, "GetObject", f"a Content-Range starting at byte {offset}")
            if end is not None and len(data) > end - offset:
                raise self._malformed(name, "GetObject", f"at most the {end - offset} bytes asked for")
        return data

    @sdk_boundary
    def delete(self, name: str) -> None:
        with self._errors(name):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(name))  # absent: S3 answers 204 too

    @sdk_boundary
    def delete_many(self, names: builtins.list[str]) -> None:
        """DeleteObjects, 1,000 names per request, each request retried through the resilience layer for the names
        it has not deleted yet. An absent name is success (S3 reports it deleted). The reply must account for every
        name asked (each deleted or in error): a reply that does not is cut or malformed, a transient fault. Per-name
        errors: throttling and server errors are transient (retried), others a :class:`StorageError` naming the
        names not deleted. A server that refuses DeleteObjects itself (``NotImplemented``, ``MethodNotAllowed``:
        S3-compatible servers without it) is remembered by the store, and its names go one DeleteObject each, now
        and from then on."""
        keys = {self._key(name): name for name in dict.fromkeys(names)}  # every name checked before any request
        ordered = builtins.list(keys)
        for start in range(0, len(ordered), _DELETE_BATCH):
            remaining = ordered[start : start + _DELETE_BATCH]

            def attempt(batch: builtins.list[str] = remaining) -> None:
                failed, error = self._delete_batch(builtins.list(batch), keys)
                batch[:] = failed  # what a retry still has to delete (all of it when DeleteObjects is refused)
                if error is not None:
                    raise error

            if not self._batch_delete_refused:
                self._request("delete_many", attempt, True)
            for key in remaining:  # none, unless the server refuses DeleteObjects
                self._request("delete", functools.partial(self._delete_absent_too, keys[key]), True)

    @sdk_boundary
    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        """One DeleteObject with ``If-Match: <ETag>`` per name, in parallel on the part pool, each retried and hedged
        through the resilience layer: deleted (204), kept because written since (412 ``PreconditionFailed``, told
        apart from an absent blob by a HEAD, as some servers answer 412 for an absent name), absent (404: success).
        Not DeleteObjects: S3 takes an ETag per object there, but moto (5.2.5) ignores it and would delete
        unconditionally, and a server that silently ignores a condition must never be trusted with one. The cost:
        one request per deleted blob instead of one per 1,000 (S3 bills no DELETE). A retry after a lost reply finds
        a deleted blob absent (success) and a rewritten one changed (kept). The ETag is the MD5 of the bytes
        (:attr:`versions_follow_bytes`): a rewrite of the same bytes is not told apart, so writers that may write a
        name again make each write's bytes their own."""
        keys = {name: self._key(name) for name in versions}  # every name checked before any request
        if not keys:
            return frozenset()

        def delete_one(name: str) -> bool:
            """Whether ``name`` was kept: written since its version was taken."""

            def attempt() -> bool:
                with self._errors(name):
                    try:
                        self._client.delete_object(Bucket=self.bucket, Key=keys[name], IfMatch=versions[name])
                    except boto_errors.ClientError as exc:
                        code = _code(exc)
                        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                        if code == "NoSuchBucket":
                            raise
                        if code in _NOT_FOUND_CODES or status == 404:
                            return False  # absent: deleted by an earlier attempt or another collector
                        if code == "PreconditionFailed" or status == 412:
                            return True
                        if code == "ConditionalRequestConflict" or status == 409:
                            raise TransientStorageError(
                                f"{self.describe()} answered {status} {code} to the conditional delete of {name!r} "
                                "(a concurrent write of the name); worth a retry"
                            ) from sanitized(exc, self._secrets())
                        raise
                return False

            changed = self._request("delete_if_unchanged", attempt, True)
            return changed and self._present(name)

        kept = run_all(part_pool(self.max_concurrency), [functools.partial(delete_one, name) for name in keys])
        return frozenset(name for name, was_kept in zip(keys, kept, strict=True) if was_kept)

    def _present(self, name: str) -> bool:
        try:
            self._request("head", functools.partial(self.head, name), True)
        except NotFoundError:
            return False
        return True

    def _delete_absent_too(self, name: str) -> None:
        """:meth:`delete`, for a server that may answer NoSuchKey for an absent name (S3 answers 204)."""
        with contextlib.suppress(NotFoundError):
            self.delete(name)

    def _delete_batch(
        self, batch: builtins.list[str], keys: Mapping[str, str]
    ) -> tuple[builtins.list[str], StorageError | None]:
        """One DeleteObjects of ``batch`` (keys): the keys it did not delete and the error saying why (``None``: all
        deleted). A request that failed as a whole, or a reply that does not account for every key, raises."""
        if not batch:
            return [], None
        what = f"{keys[batch[0]]!r} and {len(batch) - 1} more" if len(batch) > 1 else repr(keys[batch[0]])
        with self._errors(what):
            try:
                reply = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": key} for key in batch], "Quiet": False}
                )
            except boto_errors.ClientError as exc:
                if not _refuses_batch_delete(exc):
                    raise
                _log.warning(
                    "%s refuses DeleteObjects (%s): it deletes one name a request from now on",
                    self.describe(),
                    _code(exc) or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
                )
                self._batch_delete_refused = True
                return batch, None
        deleted = {str(item.get("Key")) for item in reply.get("Deleted") or []}
        errors = {str(item.get("Key")): item for item in reply.get("Errors") or []}
        # S3 reports an absent key deleted; a compatible server that says NoSuchKey means the same
        deleted.update(key for key, item in errors.items() if str(item.get("Code", "")) in _NOT_FOUND_CODES)
        errors = {key: item for key, item in errors.items() if key not in deleted}
        unanswered = [key for key in batch if key not in deleted and key not in errors]
        if unanswered:
            raise self._malformed(
                keys[unanswered[0]],
                "DeleteObjects",
                f"a result for each of its {len(batch)} keys ({len(unanswered)} missing)",
            )
        failed = [key for key in batch if key in errors]
        if not failed:
            return [], None
        codes = {str(errors[key].get("Code", "")) for key in failed}
        shown = ", ".join(repr(keys[key]) for key in failed[:3]) + (" ..." if len(failed) > 3 else "")
        message = (
            f"{self.describe()} did not delete {len(failed)} of {len(batch)} blobs ({shown}): "
            f"{', '.join(sorted(codes))}"
        )
        if codes <= _TRANSIENT_CODES:
            return failed, TransientStorageError(message + "; worth a retry")
        if codes & _AUTH_CODES:
            return failed, StorageError(message + ": check the credentials' delete permission and the bucket policy")
        return failed, StorageError(message)

    def _list(self, prefix: str) -> Iterator[str]:
        """The raw listing under the base's template (which checks the prefix, the order and every name)."""
        return iter(self._list_names(prefix))

    @sdk_boundary
    def _list_names(self, prefix: str) -> builtins.list[str]:
        """Every name under ``prefix``, one ListObjectsV2 page at a time, each page checked (see the module
        docstring): a page that fails is a transient fault and the resilience layer lists again from the start."""
        root = self._root()
        wanted = root + prefix
        names: builtins.list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": wanted}
            if self.list_page_size is not None:
                kwargs["MaxKeys"] = self.list_page_size
            if token is not None:
                kwargs["ContinuationToken"] = token
            with self._errors(prefix or "(all)"):
                page = self._client.list_objects_v2(**kwargs)
            contents = page.get("Contents") or []
            problem = _page_problem(page, self.bucket, wanted, len(contents) + len(page.get("CommonPrefixes") or []))
            if problem is None and any(not str(item.get("Key", "")).startswith(wanted) for item in contents):
                problem = "a key outside the prefix asked for"
            if problem is not None:
                raise TransientStorageError(
                    f"a ListObjectsV2 page of {self.describe()} for prefix {prefix!r} is not valid ({problem}): the "
                    "reply was cut or malformed; worth a retry"
                )
            names.extend(item["Key"][len(root) :] for item in contents)
            if not page["IsTruncated"]:
                return sorted(names)
            token = str(page["NextContinuationToken"])

    @sdk_boundary
    def head(self, name: str) -> BlobInfo:
        with self._errors(name):
            response = self._client.head_object(Bucket=self.bucket, Key=self._key(name))
        if not isinstance(response.get("ContentLength"), int) or not response.get("ETag"):
            raise self._malformed(name, "HeadObject", "Content-Length and ETag")
        return BlobInfo(
            name=name,
            size=int(response["ContentLength"]),
            metadata=dict(response.get("Metadata") or {}),
            etag=str(response["ETag"]),
        )

    @sdk_boundary
    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        key = self._key(name)
        checked = check_metadata(metadata)
        with self._errors(name):
            self._client.copy_object(
                Bucket=self.bucket,
                Key=key,
                CopySource={"Bucket": self.bucket, "Key": key},
                Metadata=checked,
                MetadataDirective="REPLACE",
            )

    # -- administration ---------------------------------------------------------------------------------------

    @sdk_boundary
    def validate(self) -> None:
        """Raise one :class:`StorageError` saying what to fix when the bucket is missing, the credentials are
        refused or the endpoint cannot be reached."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except boto_errors.ClientError as exc:
            code = _code(exc)
            if code in {"404", "NoSuchBucket", "NotFound"}:
                raise StorageError(self._missing_bucket_message()) from exc
            raise self._translate(exc, "(bucket)", False) from exc
        except boto_errors.NoCredentialsError as exc:
            raise self._translate(exc, "(bucket)", False) from exc
        except _TRANSIENT_BOTO as exc:
            raise StorageError(
                f"cannot reach {self.describe()}: check blob.store.endpoint.url (or AWS_ENDPOINT_URL) "
                "and that the service is up"
            ) from exc

    @sdk_boundary
    def create_resources(self) -> None:
        """Create the bucket if it does not exist (idempotent)."""
        with self._errors("(bucket)"):
            try:
                kwargs: dict[str, Any] = {"Bucket": self.bucket}
                region = self._client.meta.region_name
                if region and region != "us-east-1":
                    kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
                self._client.create_bucket(**kwargs)
            except boto_errors.ClientError as exc:
                if _code(exc) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                    raise

    def close(self) -> None:
        self._client.close()

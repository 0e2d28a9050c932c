"""``az://container/prefix``: Azure Blob Storage through azure-storage-blob (tested against Azurite).

Contract (the BlobStore contract of statebackend.blobstores.base, plus):

- Blob names live under ``prefix/`` inside ``container``; the store never reads or writes outside it.
- ``put(create_only=True)`` sends ``If-None-Match: *``; the service's 409 ``BlobAlreadyExists`` becomes
  :class:`AlreadyExistsError`. Large files are staged as blocks in parallel and committed with one
  ``Put Block List`` carrying the same condition, so a create-only large upload is atomic and create-only too.
- ``head`` gives the blob's ETag, which the service changes on every write (the same bytes too, and metadata);
  ``delete_if_unchanged`` sends it as ``If-Match`` with each delete of a Blob Batch and takes 412
  ``ConditionNotMet`` for "written since, kept" (a 412 for a lease on the blob is an error, as for ``delete``).
- A compare-and-swap (``supports_conditional_put``): ``put_if`` is Put Blob with ``If-Match: <ETag>`` (or
  ``If-None-Match: *`` to create) and returns the new ETag; 412 ``ConditionNotMet``, 409 ``BlobAlreadyExists`` and
  404 ``BlobNotFound`` (``If-Match`` on an absent blob) are :class:`~statebackend.errors.PreconditionFailedError`.
  ``get_versioned`` is one Get Blob and its ETag.
- An absent blob is :class:`NotFoundError`; a missing container, a refused credential or a bad request is
  :class:`StorageError` saying what to fix; throttling (429, 503), other 5xx, resets, timeouts, replies cut short
  (no status code: ``IncompleteReadError``) and replies cut inside their head or missing a mandatory field (the
  SDK's ``DeserializationError``, ``AttributeError``, ``ValueError``, ``KeyError``, ``TypeError``; a listing page
  that does not echo its container and prefix; a download shorter than its Content-Length) are
  :class:`TransientStorageError`. No SDK or stdlib exception reaches a caller, and errors are chained to sanitized
  stand-ins (statebackend.redact), never to the SDK's exception.
- The SDK's own retries are off: :class:`~statebackend.blobstores.resilience.ResilientBlobStore` (which ``from_url``
  returns) does retries, hedging and timeouts, per block for large transfers.
- Credentials (connection string, account key, SAS, credential objects) are never logged, never in ``repr`` and
  never in a message: they are registered with statebackend.redact, whose filter also guards the SDK's loggers.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import functools
import logging
import os
import re
import threading
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

from statebackend.blobstores.azure_boundary import TRANSIENT_STATUS, AzureBoundary, error_code
from statebackend.blobstores.base import BlobInfo, check_blob_name, check_metadata
from statebackend.blobstores.parted import MIN_PART_SIZE, PartedBlobStore, part_pool, part_ranges, sdk_boundary
from statebackend.blobstores.resilience import Resilience, ResilientBlobStore
from statebackend.concurrency import run_all
from statebackend.errors import ConfigError, NotFoundError, StorageError, TransientStorageError
from statebackend.options import OptionSpec, default_of, parse_object, parse_str, value_error
from statebackend.redact import (
    connection_string_secrets,
    credential_secrets,
    protect_sdk_loggers,
    redact,
    url_has_userinfo,
)

try:
    from azure.core import MatchConditions
    from azure.core import exceptions as azure_errors
    from azure.storage.blob import BlobServiceClient
except ImportError as exc:  # pragma: no cover - the registry turns this into an install hint
    raise ImportError("az:// needs azure-storage-blob: pip install 'statebackend[azure]'") from exc

__all__ = ["AzureBlobStore"]

_log = logging.getLogger(__name__)

#: deletes in one Blob Batch request (the service's limit)
_DELETE_BATCH = 256
#: a conditional delete's 412 that means "another version now" (an absent blob too, on Azurite); no code: a reply
#: cut inside its part, taken the safe way (kept). Any other 412 (``LeaseIdMissing``: a leased blob) is an error,
#: as for a plain delete
_CHANGED_CODES = {"ConditionNotMet", ""}
_CONTAINER_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{1,61})[a-z0-9]$")


def _parse_account_url(key: str, raw: Any) -> str:
    """``blob.store.account.url``: an http(s) URL without ``user:password@``. A bad one is never echoed: its query
    may be a SAS."""
    if isinstance(raw, str) and raw.strip():
        url = raw.strip()
        if url.startswith(("http://", "https://")) and not url_has_userinfo(url):
            return url
    raise value_error(key, "<not echoed>", "not an http(s) URL without user:password@", "http(s)://<host>[/?<sas>]")


class AzureBlobStore(AzureBoundary):
    """One container (and an optional prefix) of an Azure storage account. Thread-safe."""

    supports_conditional_delete = True
    supports_conditional_put = True

    options: ClassVar[Mapping[str, OptionSpec]] = {
        **PartedBlobStore.options,
        "connection.string": OptionSpec(parse_str(), None, "Azure storage connection string", secret=True),
        "account.url": OptionSpec(
            _parse_account_url, None, "Azure account URL, https://<account>.blob.core.windows.net"
        ),
        "credential": OptionSpec(
            parse_object(), None, "Azure credential: an account key, a SAS token or a credential object", secret=True
        ),
    }

    def __init__(
        self,
        service: BlobServiceClient,
        container: str,
        prefix: str = "",
        *,
        url: str,
        part_size: int = default_of(PartedBlobStore.options, "part.size.bytes"),
        max_concurrency: int = default_of(PartedBlobStore.options, "max.concurrency"),
        create_if_missing: bool = default_of(PartedBlobStore.options, "create.if.missing"),
        secrets: tuple[str, ...] = (),
    ) -> None:
        self._secret_values = secrets
        if not container:
            raise ConfigError(f"blob.store.url {url!r} names no container: use az://<container>/<prefix>")
        self.url = url
        self.container = container
        self.prefix = prefix.strip("/")
        self.part_size = max(part_size, 1)
        self.max_concurrency = max_concurrency
        self.create_if_missing = create_if_missing
        self._service = service
        self._container_client = service.get_container_client(container)
        self._resilience: Resilience | None = None
        #: names per listing request; None leaves the service's page (5,000 on Azure, 1,000 on S3). The
        #: continuation logic is the same at any size: tests set it small to list past pages cheaply.
        self.list_page_size: int | None = None
        self._created_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, Any]) -> ResilientBlobStore:
        """Open ``az://container/prefix`` wrapped in :class:`ResilientBlobStore`.

        Credentials, first found wins: ``connection.string``; ``account.url`` with ``credential`` (account key or
        SAS) or, without one, azure-identity's DefaultAzureCredential when installed; the
        ``AZURE_STORAGE_CONNECTION_STRING`` environment variable. ``options`` as :meth:`parse_options` gives them;
        the store and its resilience layer use them as they are.
        """
        return ResilientBlobStore.wrap(cls.open_inner(url, options), options)

    @classmethod
    def open_inner(cls, url: str, options: Mapping[str, Any]) -> AzureBlobStore:
        """The store without the resilience wrapper (tests, benchmarks); ``options`` raw, or parsed (used as they
        are)."""
        options = cls.parse_options(options)
        parts = urlsplit(url)
        if parts.scheme != "az":
            raise ConfigError(f"blob.store.url {redact(url)!r} is not an az:// URL")
        if url_has_userinfo(url) or parts.query or parts.fragment:
            raise ConfigError(
                "blob.store.url must be az://<container>/<prefix> without credentials, query or fragment (not "
                "echoed here): put an account key or SAS in blob.store.credential or blob.store.connection.string"
            )
        container, prefix = parts.netloc, parts.path.strip("/")
        if container and not _CONTAINER_RE.match(container):
            raise ConfigError(
                "blob.store.url: the container name after az:// is not a valid Azure container name (3-63 "
                "lowercase letters, digits and '-'); credentials never go in the URL"
            )
        timeout_s = options["request.timeout.ms"] / 1000
        max_concurrency = options["max.concurrency"]
        part_size = options["part.size.bytes"]
        client_kwargs: dict[str, Any] = {
            "retry_total": 0,  # ResilientBlobStore retries; two retry layers would multiply attempts
            "connection_timeout": timeout_s,
            "read_timeout": timeout_s,
            "max_single_put_size": 256 << 20,
            "max_single_get_size": 256 << 20,
        }
        connection_string = options.get("connection.string")
        account_url = options.get("account.url")
        credential = options.get("credential")
        env_string = os.environ.get("AZURE_STORAGE_CONNECTION_STRING") or None
        secrets = (
            *connection_string_secrets(connection_string),
            *credential_secrets(credential),
            *_account_url_secrets(account_url),
            *connection_string_secrets(env_string),
        )
        protect_sdk_loggers(secrets)  # the SDK logs request URLs (with a SAS) at DEBUG
        try:
            if connection_string:
                service = BlobServiceClient.from_connection_string(connection_string, **client_kwargs)
            elif account_url:
                service = BlobServiceClient(
                    account_url, credential=credential or _default_credential(), **client_kwargs
                )
            elif env_string:
                service = BlobServiceClient.from_connection_string(env_string, **client_kwargs)
            else:
                raise ConfigError(
                    f"no Azure credentials for {url}: set blob.store.connection.string, or blob.store.account.url "
                    "(with blob.store.credential or azure-identity installed), or AZURE_STORAGE_CONNECTION_STRING"
                )
        except (ValueError, TypeError, azure_errors.AzureError) as exc:
            if isinstance(exc, ConfigError):
                raise
            # the SDK's message may quote the string it could not parse: keep only the exception type
            raise ConfigError(
                f"the Azure connection settings for {url} are malformed ({type(exc).__name__}); check "
                "blob.store.connection.string / blob.store.account.url / blob.store.credential / "
                "AZURE_STORAGE_CONNECTION_STRING"
            ) from None
        return cls(
            service,
            container,
            prefix,
            url=url,
            part_size=part_size,
            max_concurrency=max_concurrency,
            create_if_missing=options["create.if.missing"],
            secrets=tuple(secret for secret in secrets if secret),
        )

    def __repr__(self) -> str:
        return f"AzureBlobStore(url={self.url!r}, account={self._service.account_name!r})"  # no secret in either

    def describe(self) -> str:
        return f"Azure blob store {self.url} (account {self._service.account_name})"

    # -- the core -----------------------------------------------------------------------------------------------

    @sdk_boundary
    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        blob = self._blob(name)
        checked = check_metadata(metadata) or None
        with self._errors(name, create_only=create_only):
            self._with_container(
                lambda: blob.upload_blob(bytes(data), overwrite=not create_only, metadata=checked, max_concurrency=1)
            )

    @sdk_boundary
    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        blob = self._blob(name)
        kwargs: dict[str, Any] = {"max_concurrency": 1}
        if version is None:
            kwargs["overwrite"] = False  # If-None-Match: *
        else:
            kwargs.update(overwrite=True, etag=version, match_condition=MatchConditions.IfNotModified)
        with self._errors(name, conditional=True):
            reply = self._with_container(lambda: blob.upload_blob(bytes(data), **kwargs))
            etag = reply.get("etag") if isinstance(reply, Mapping) else None
            if not etag:
                raise TransientStorageError(
                    f"the Put Blob reply of {self.describe()} for {name!r} lacks an ETag: it was cut or malformed; "
                    "worth a retry"
                )
        return str(etag)

    @sdk_boundary
    def get_versioned(self, name: str) -> tuple[bytes, str]:
        blob = self._blob(name)
        with self._errors(name):
            downloader = blob.download_blob(max_concurrency=1)
            data = bytes(downloader.readall())
            etag = downloader.properties.etag
        expected = downloader.size
        if not isinstance(expected, int) or len(data) != expected or not etag:
            raise TransientStorageError(
                f"{self.describe()} sent {len(data)} bytes of {name!r} where its reply promised {expected} (ETag "
                f"{'given' if etag else 'missing'}); the reply was cut short; worth a retry"
            )
        return data, str(etag)

    @sdk_boundary
    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        blob = self._blob(name)
        _check_range(start, end)
        offset = start or 0
        if end is not None and end <= offset:
            self.head(name)  # an empty range of an absent blob is still NotFoundError
            return b""
        length = None if end is None else end - offset
        with self._errors(name):
            try:
                downloader = blob.download_blob(
                    offset=offset if (offset or length is not None) else None, length=length, max_concurrency=1
                )
                data = bytes(downloader.readall())
            except azure_errors.HttpResponseError as exc:
                if exc.status_code == 416:  # start beyond the end: the range is clamped to nothing
                    return b""
                raise
        expected = downloader.size  # the range's length as the reply's Content-Range / Content-Length state it
        if not isinstance(expected, int) or len(data) != expected or (length is not None and len(data) > length):
            raise TransientStorageError(
                f"{self.describe()} sent {len(data)} bytes of {name!r} where its reply promised {expected}; the "
                "reply was cut short; worth a retry"
            )
        return data

    @sdk_boundary
    def delete(self, name: str) -> None:
        blob = self._blob(name)
        with self._errors(name):
            try:
                blob.delete_blob()
            except azure_errors.ResourceNotFoundError as exc:
                if error_code(exc) == "ContainerNotFound":
                    raise
                # an absent blob is success

    @sdk_boundary
    def delete_many(self, names: builtins.list[str]) -> None:
        """Blob Batch deletes, 256 names per request, each request retried through the resilience layer for the
        names it has not deleted yet. An absent blob (404 ``BlobNotFound``) is success; a missing container is the
        :class:`StorageError` of :meth:`delete`. The reply must hold one answer per name asked: one that does not is
        cut or malformed, a transient fault. Per-name answers: throttling and server errors are transient
        (retried), others a :class:`StorageError` naming the names not deleted."""
        self._delete_batches("delete_many", {self._root() + check_blob_name(name): None for name in names})

    @sdk_boundary
    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        """:meth:`delete_many` with each delete conditional on the blob's ETag (``If-Match``): a blob written since
        answers 412 ``ConditionNotMet`` and is kept (returned), an absent one is success. An absent blob may answer
        412 too (Azurite does: RFC 9110 has no representation match ``If-Match``), so each 412 is told apart with a
        HEAD: absent is success, present is kept. A retry after a lost reply finds a deleted blob absent (success)
        and a rewritten one changed (kept)."""
        etags = {self._root() + check_blob_name(name): etag for name, etag in versions.items()}
        root = len(self._root())
        return frozenset(
            name
            for name in (path[root:] for path in self._delete_batches("delete_if_unchanged", etags))
            if self._present(name)
        )

    def _present(self, name: str) -> bool:
        try:
            self._request("head", functools.partial(self.head, name), True)
        except NotFoundError:
            return False
        return True

    def _delete_batches(self, operation: str, etags: Mapping[str, str | None]) -> builtins.set[str]:
        """Delete ``etags`` (path -> the ETag a delete is conditional on, or None) in batches, each retried for what
        it has not settled; the paths kept because their ETag changed."""
        ordered = builtins.list(etags)
        kept: builtins.set[str] = set()
        for start in range(0, len(ordered), _DELETE_BATCH):
            remaining = ordered[start : start + _DELETE_BATCH]

            def attempt(batch: builtins.list[str] = remaining) -> None:
                failed, error, changed = self._delete_batch(builtins.list(batch), etags)
                kept.update(changed)
                batch[:] = failed  # what a retry still has to delete
                if error is not None:
                    raise error

            self._request(operation, attempt, True)
        return kept

    def _delete_batch(
        self, batch: builtins.list[str], etags: Mapping[str, str | None]
    ) -> tuple[builtins.list[str], StorageError | None, builtins.list[str]]:
        """One Blob Batch of deletes of ``batch`` (paths in the container, each conditional on its ETag in
        ``etags`` where one is given): the paths it did not delete, the error saying why (``None``: all deleted or
        kept), and the paths kept because their ETag changed (412). A request that failed as a whole, or a reply
        without an answer for each path, raises.

        The SDK pairs the answers with the deletes by position (azure-core reads the parts of the multipart reply
        in order and drops each part's ``Content-ID``), so the count is all this can check: a reply with one answer
        per delete, in the order sent, is what the service promises."""
        if not batch:
            return [], None, []
        root = len(self._root())
        what = f"{batch[0][root:]!r} and {len(batch) - 1} more" if len(batch) > 1 else repr(batch[0][root:])
        deletes: builtins.list[Any] = [
            path
            if etags[path] is None
            else {"name": path, "etag": etags[path], "match_condition": MatchConditions.IfNotModified}
            for path in batch
        ]
        with self._errors(what):
            answers = builtins.list(self._container_client.delete_blobs(*deletes, raise_on_any_failure=False))
            statuses = [(answer.status_code, str(answer.headers.get("x-ms-error-code") or "")) for answer in answers]
        if len(statuses) != len(batch) or any(not isinstance(status, int) for status, _ in statuses):
            raise TransientStorageError(
                f"the Blob Batch reply of {self.describe()} for {what} holds {len(statuses)} answers for "
                f"{len(batch)} deletes: the reply was cut or malformed; worth a retry"
            )
        failed: builtins.list[str] = []
        changed: builtins.list[str] = []
        codes: set[str] = set()
        transient = True
        for path, (status, code) in zip(batch, statuses, strict=True):
            if 200 <= status < 300 or (status == 404 and code != "ContainerNotFound"):
                continue  # deleted, or absent: success
            if status == 412 and etags[path] is not None and code in _CHANGED_CODES:
                changed.append(path)  # written since the HEAD that gave the ETag: kept (412 LeaseIdMissing: not)
                continue
            failed.append(path)
            codes.add(f"{status} {code}".strip())
            transient = transient and (status in TRANSIENT_STATUS or status >= 500)
        if not failed:
            return [], None, changed
        shown = ", ".join(repr(path[root:]) for path in failed[:3]) + (" ..." if len(failed) > 3 else "")
        message = (
            f"{self.describe()} did not delete {len(failed)} of {len(batch)} blobs ({shown}): "
            f"{', '.join(sorted(codes))}"
        )
        if transient:
            return failed, TransientStorageError(message + "; worth a retry"), changed
        if any(code.endswith("ContainerNotFound") for code in codes):
            return (
                failed,
                StorageError(
                    f"container {self.container!r} does not exist in {self.describe()}: create it or set "
                    "blob.store.create.if.missing=true"
                ),
                changed,
            )
        if any(code.startswith("403") for code in codes):
            return (
                failed,
                StorageError(
                    message
                    + ": check the account key / SAS (its delete permission) in blob.store.connection.string or "
                    "blob.store.credential (or AZURE_STORAGE_CONNECTION_STRING)"
                ),
                changed,
            )
        return failed, StorageError(message), changed

    def _list(self, prefix: str) -> Iterator[str]:
        """The raw listing under the base's template (which checks the prefix, the order and every name)."""
        return iter(self._list_names(prefix))

    @sdk_boundary
    def _list_names(self, prefix: str) -> builtins.list[str]:
        """Every name under ``prefix``, page by page; a page that does not echo the container and prefix it was
        asked for (a reply cut inside its head parses as an empty page) is a transient fault, so the resilience
        layer lists again from the start instead of taking a short listing for the truth."""
        root = self._root()
        wanted = root + prefix
        names: builtins.list[str] = []
        with self._errors(prefix or "(all)"):
            pages: Any = self._container_client.list_blobs(
                name_starts_with=wanted, results_per_page=self.list_page_size
            ).by_page()
            for page in pages:
                items = [item.name for item in page]
                echoed = (pages.container, pages.prefix or "", bool(pages.service_endpoint))
                if echoed != (self.container, wanted, True):
                    raise TransientStorageError(
                        f"a listing page of {self.describe()} for prefix {prefix!r} lacks its mandatory fields "
                        "(ContainerName, Prefix, ServiceEndpoint): the reply was cut or malformed; worth a retry"
                    )
                if any(not isinstance(item, str) or not item.startswith(wanted) for item in items):
                    raise TransientStorageError(
                        f"a listing page of {self.describe()} for prefix {prefix!r} holds a name outside the prefix "
                        "or none: the reply was malformed; worth a retry"
                    )
                names.extend(item[len(root) :] for item in items)
        return sorted(names)

    @sdk_boundary
    def head(self, name: str) -> BlobInfo:
        blob = self._blob(name)
        with self._errors(name):
            props = blob.get_blob_properties()
        if not isinstance(props.size, int) or not props.etag:
            raise TransientStorageError(
                f"the properties of {name!r} from {self.describe()} lack Content-Length or ETag: the reply was cut "
                "inside its head; worth a retry"
            )
        return BlobInfo(name=name, size=int(props.size), metadata=dict(props.metadata or {}), etag=str(props.etag))

    @sdk_boundary
    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        blob = self._blob(name)
        checked = check_metadata(metadata)
        with self._errors(name):
            blob.set_blob_metadata(checked)

    # -- large transfers: parallel blocks and ranges --------------------------------------------------------------

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
        part_size = max(self.part_size, MIN_PART_SIZE)
        blob = self._blob(name)
        upload_id = uuid.uuid4().hex  # block ids unique per upload: concurrent uploads of one name never mix
        ranges = part_ranges(size, part_size)
        block_ids = [base64.b64encode(f"{upload_id}-{i:06d}".encode()).decode() for i in range(len(ranges))]

        def stage(index: int) -> None:
            start, end = ranges[index]
            with open(path, "rb") as f:
                f.seek(start)
                chunk = f.read(end - start)
            with self._errors(name):
                self._with_container(lambda: blob.stage_block(block_ids[index], chunk))

        run_all(
            part_pool(self.max_concurrency),
            [
                functools.partial(
                    self._request, "stage_block", functools.partial(stage, i), True, sent=ranges[i][1] - ranges[i][0]
                )
                for i in range(len(ranges))
            ],
        )

        def commit() -> None:
            with self._errors(name, create_only=create_only):
                blob.commit_block_list(
                    block_ids,
                    metadata=check_metadata(metadata) or None,
                    match_condition=MatchConditions.IfMissing if create_only else None,
                )

        own = (lambda: self._stored_equals_file(name, size, path, metadata)) if create_only else None
        self._request("commit_block_list", commit, True, own)

    # -- administration ---------------------------------------------------------------------------------------

    @sdk_boundary
    def validate(self) -> None:
        """Raise one :class:`StorageError` saying what to fix when the container is missing, the credential is
        refused or the endpoint cannot be reached."""
        try:
            with self._errors("(container)"):
                self._container_client.get_container_properties()
        except TransientStorageError as exc:
            raise StorageError(
                f"cannot reach {self.describe()} at {redact(self._service.primary_endpoint, self._secrets())}: check "
                "the endpoint in blob.store.connection.string / blob.store.account.url and that the service is up"
            ) from exc

    @sdk_boundary
    def create_resources(self) -> None:
        """Create the container if it does not exist (idempotent)."""
        with self._errors("(container)"), contextlib.suppress(azure_errors.ResourceExistsError):
            self._container_client.create_container()

    def close(self) -> None:
        self._service.close()


def _check_range(start: int | None, end: int | None) -> None:
    if (start is not None and start < 0) or (end is not None and end < 0):
        raise ConfigError(f"byte range [{start}, {end}) must not be negative")


def _account_url_secrets(account_url: str | None) -> tuple[str, ...]:
    """A SAS token in the account URL's query, and its signature."""
    if not account_url:
        return ()
    query = urlsplit(account_url).query
    return credential_secrets(query) if query else ()


def _default_credential() -> Any:
    try:
        from azure.identity import DefaultAzureCredential  # optional dependency, imported only when used
    except ImportError:
        return None  # anonymous (public container) or a SAS already in account.url
    return DefaultAzureCredential()

"""The SDK boundary of the ``az://`` store (:mod:`statebackend.blobstores.azure`): where a blob is (under the prefix,
in the container), the container made on demand (``create.if.missing``), and the translation of the Azure SDK's and
the stdlib's exceptions into statebackend errors, redacted and chained to sanitized stand-ins (what the store's
module docstring promises). :class:`AzureBoundary` is a base of :class:`~statebackend.blobstores.azure.AzureBlobStore`,
which holds the requests themselves.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from statebackend.blobstores.base import check_blob_name
from statebackend.blobstores.parted import PartedBlobStore
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
    from azure.core import exceptions as azure_errors
    from requests import exceptions as requests_errors
    from urllib3 import exceptions as urllib3_errors
except ImportError as exc:  # pragma: no cover - the registry turns this into an install hint
    raise ImportError("az:// needs azure-storage-blob: pip install 'statebackend[azure]'") from exc

__all__ = ["MALFORMED_REPLY", "TRANSIENT_STATUS", "AzureBoundary", "error_code"]

T = TypeVar("T")

#: the HTTP statuses a retry may fix (timeouts, throttling, server errors)
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}

#: what the SDK (or the stdlib under it) raises for a reply cut inside its head or body, or missing a mandatory
#: header or field: the request may or may not have been served; worth a retry for an idempotent request
MALFORMED_REPLY = (
    azure_errors.DeserializationError,  # a ValueError, not an AzureError
    http.client.HTTPException,
    urllib3_errors.HTTPError,
    requests_errors.RequestException,
    OSError,
    AttributeError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
)


def error_code(exc: Exception) -> str:
    """The service's error code of an SDK exception (``ContainerNotFound``, ...), or "" when it has none."""
    code = getattr(exc, "error_code", None)
    return str(getattr(code, "value", code) or "")


class AzureBoundary(PartedBlobStore):
    """The blob, container and error helpers of :class:`~statebackend.blobstores.azure.AzureBlobStore` (set up by
    its ``__init__``)."""

    #: the container
    container: str
    #: the name prefix inside the container, without ``/`` at either end ("" for the whole container)
    prefix: str
    #: whether a write to a missing container creates it (``blob.store.create.if.missing``)
    create_if_missing: bool
    _container_client: Any
    _created_lock: threading.Lock
    _secret_values: tuple[str, ...]

    def _root(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def _blob(self, name: str) -> Any:
        check_blob_name(name)
        return self._container_client.get_blob_client(self._root() + name)

    def _with_container(self, write: Callable[[], T]) -> T:
        """Run a write; with ``create.if.missing`` a missing container is created once and the write redone."""
        try:
            return write()
        except azure_errors.ResourceNotFoundError as exc:
            if not (self.create_if_missing and error_code(exc) == "ContainerNotFound"):
                raise
        with self._created_lock:
            self.create_resources()
        return write()

    def _secrets(self) -> tuple[str, ...]:
        return self._secret_values

    @contextmanager
    def _errors(self, name: str, *, create_only: bool = False, conditional: bool = False) -> Iterator[None]:
        """Translate SDK and stdlib exceptions at the boundary; the chained cause is a sanitized stand-in.
        ``conditional``: a :meth:`put_if`, whose refusals are :class:`PreconditionFailedError`."""
        try:
            yield
        except StateBackendError:
            raise
        except azure_errors.AzureError as exc:
            if conditional:
                code = error_code(exc)
                status = getattr(exc, "status_code", None)
                if status in (409, 412) or (status == 404 and code == "BlobNotFound"):
                    raise PreconditionFailedError(
                        f"blob {name!r} in {self.describe()} is not at the version the conditional write gave "
                        f"({status} {code}): not written"
                    ) from sanitized(exc, self._secrets())
            raise self._translate(exc, name, create_only) from sanitized(exc, self._secrets())
        except MALFORMED_REPLY as exc:
            raise TransientStorageError(
                f"the reply of {self.describe()} for {name!r} was cut short or malformed ({type(exc).__name__}: "
                f"{self._safe(exc)}); worth a retry"
            ) from sanitized(exc, self._secrets())

    def _translate(self, exc: Exception, name: str, create_only: bool) -> Exception:
        where = self.describe()
        code = error_code(exc)
        status = getattr(exc, "status_code", None)
        if isinstance(exc, azure_errors.ResourceExistsError) and (create_only or code == "BlobAlreadyExists"):
            return AlreadyExistsError(f"blob {name!r} already exists in {where}")
        if create_only and status == 412 and code in {"ConditionNotMet", ""}:  # If-None-Match: * on a taken name
            return AlreadyExistsError(f"blob {name!r} already exists in {where}")
        if isinstance(exc, azure_errors.ResourceNotFoundError):
            if code == "ContainerNotFound":
                return StorageError(
                    f"container {self.container!r} does not exist in {where}: create it or set "
                    "blob.store.create.if.missing=true"
                )
            return NotFoundError(f"blob {name!r} not found in {where}")
        if isinstance(exc, azure_errors.ClientAuthenticationError) or status == 403:
            return StorageError(
                f"{where} refused the credential ({code or status}): check the account key / SAS in "
                "blob.store.connection.string or blob.store.credential (or AZURE_STORAGE_CONNECTION_STRING)"
            )
        if isinstance(exc, (azure_errors.ServiceRequestError, azure_errors.ServiceResponseError)):
            return TransientStorageError(f"network error on {name!r} in {where}: {self._safe(exc)}")
        if isinstance(exc, (azure_errors.IncompleteReadError, azure_errors.DecodeError)) or (
            isinstance(exc, azure_errors.HttpResponseError) and (status is None or status < 400)
        ):
            # no status code (the reply or its body was cut short), or a success the SDK could not take (its head
            # was cut): the request may or may not have been served
            return TransientStorageError(
                f"the reply of {where} for {name!r} was cut short ({type(exc).__name__}: {self._safe(exc)}); "
                "worth a retry"
            )
        if status in TRANSIENT_STATUS or (status is not None and status >= 500):
            return TransientStorageError(f"{where} answered {status} {code or ''} on {name!r}; worth a retry")
        if isinstance(exc, azure_errors.HttpResponseError):
            return StorageError(f"{where} answered {status} {code or ''} on {name!r}: {self._safe(exc)}")
        return TransientStorageError(f"{type(exc).__name__} on {name!r} in {where}: {self._safe(exc)}")

    def _safe(self, exc: BaseException) -> str:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return redact(text, self._secrets())

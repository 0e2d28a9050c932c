"""Probing the blob store when a job is built, so that a wrong ``blob.store.*`` setting fails at once, saying what to
fix, instead of deep in the first batch's trace.

:func:`probe_blob_store` opens the store of a job's :class:`~statebackend.config.Settings` and runs three checks in
order, stopping at the first that fails:

1. **the store exists or can be created**: the ``file://`` directory, the Azure container or the S3 bucket is there,
   or ``blob.store.create.if.missing`` lets the probe create it now; the endpoint answers;
2. **the credentials are accepted**: the service did not refuse the first request (403, a wrong key or SAS);
3. **the store is writable**: a small blob is written create-only under ``<job>/.probe/<random>``, read back and
   deleted (what every commit needs: create-only writes, reads, deletes).

Checks 1 and 2 share one request, a listing of the probe's prefix (what a task's checkpoint log needs anyway): its
answer tells a missing store (404) from a refused credential (403) from an endpoint that cannot be reached. So a
probe makes 4 requests (5 when it creates the store), each retried on a transient failure with the store's own
settings (``blob.store.retry.*``, ``blob.store.request.timeout.ms``) but at most :data:`PROBE_MAX_ATTEMPTS` attempts,
all within one time budget: ``attempts x request timeout + the first retry's backoff``; an attempt never runs past
it (a black-holed endpoint fails in about that time, not after minutes of retries).

A failure is a :class:`~statebackend.errors.StorageError` (a :class:`~statebackend.errors.TransientStorageError` when
the service answered but failed transiently every time) whose message names the check, what was found and what to
set or fix; it never holds a credential (URLs and texts go through :mod:`statebackend.redact`, causes are sanitized
stand-ins). Settings that do not even open a store raise the :class:`~statebackend.errors.ConfigError` of
:func:`~statebackend.blobstores.base.open_blob_store`.

The first request of ``az://`` and ``s3://`` is sent with the store's own SDK client, below the store's error
translation, which folds a missing container and a refused key into one :class:`StorageError` type: the probe needs
the status and code to name the failing check. Another scheme (a plug-in store, ``memory://``) gets its own
``validate()`` for checks 1 and 2 together. A probe blob left by a crash between its write and its delete is what
``statebackend gc`` removes as an orphaned task's blob after the grace period.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import secrets
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.resilience import ResilienceSettings, ResilientBlobStore
from statebackend.errors import AlreadyExistsError, StateBackendError, StorageError, TransientStorageError
from statebackend.redact import redact, sanitized, scrub_chain

if TYPE_CHECKING:
    from statebackend.config import Settings

__all__ = ["PROBE_CHECKS", "PROBE_MAX_ATTEMPTS", "BlobStoreProbeReport", "ProbeStep", "probe_blob_store"]

_log = logging.getLogger(__name__)

#: the checks, in the order they run (a failure names its number and title)
PROBE_CHECKS = (
    "the store exists or can be created",
    "the credentials are accepted",
    "the store is writable",
)
#: attempts per request at most, whatever ``blob.store.retry.max.attempts`` says: a probe must not wait minutes
PROBE_MAX_ATTEMPTS = 2

_PAYLOAD = b"statebackend blob store probe: safe to delete"

# what one request's answer was
_OK = "ok"
_MISSING = "missing"  # the container, bucket or directory is not there
_NOT_A_DIRECTORY = "not a directory"  # file:// only: the root is a file
_REFUSED = "refused"  # the service refused the credentials
_UNREACHABLE = "unreachable"  # no connection (refused, no route, DNS): no request reached the service
_NO_ANSWER = "no answer"  # no answer within the request timeout
_BUSY = "busy"  # a transient failure of a service that answered (429, 5xx, a reset or cut reply)
_TAKEN = "taken"  # a create-only write found the name taken
_FAILED = "failed"  # anything else
_RETRIED = frozenset({_UNREACHABLE, _NO_ANSWER, _BUSY})


@attrs.frozen
class ProbeStep:
    """One check that passed."""

    #: 1, 2 or 3: the position in :data:`PROBE_CHECKS`
    check: int
    #: what was found: ``exists``, ``created``, ``accepted``, ``not applicable (...)``, ``wrote, read back ...``
    outcome: str
    #: requests (attempts) it took
    requests: int

    @property
    def title(self) -> str:
        return PROBE_CHECKS[self.check - 1]


@attrs.frozen
class BlobStoreProbeReport:
    """What :func:`probe_blob_store` checked, for an INFO line (:meth:`summary`). Holds no credential."""

    #: the store as it names itself (its URL, account or endpoint; never a secret)
    store: str
    #: the checks, in order, each passed
    steps: tuple[ProbeStep, ...]
    #: whether the probe created the container, bucket or directory (``blob.store.create.if.missing``)
    created: bool
    #: requests sent in all (retries included)
    requests: int
    #: seconds the probe took
    elapsed_s: float

    def summary(self) -> str:
        """One line: the store, each check's outcome, the requests and the time."""
        steps = "; ".join(f"{step.check} {step.outcome}" for step in self.steps)
        return f"blob store {self.store} probed: {steps} ({self.requests} requests, {self.elapsed_s:.3f} s)"


def probe_blob_store(settings: Settings) -> BlobStoreProbeReport:
    """Open the job's blob store and check that it exists (or create it, with ``blob.store.create.if.missing``),
    accepts the credentials and takes a write, a read and a delete under ``<job.name>/.probe/``; see the module
    docstring. Returns what was checked; raises :class:`StorageError` naming the check that failed and what to fix,
    or the :class:`~statebackend.errors.ConfigError` of a store that cannot even be opened."""
    started = time.monotonic()
    store = open_blob_store(settings.blob_store_url, settings.blob_store_options)
    try:
        probe = _Probe(
            store=store,
            target=_target_of(store),
            budget=_Budget.of(ResilienceSettings.from_options(settings.blob_store_options), started),
            create=settings.blob_store_options.get("create.if.missing"),
            name=f"{settings.job_name}/.probe/{secrets.token_hex(8)}",
        )
        steps = probe.run()
    finally:
        store.close()
    report = BlobStoreProbeReport(
        store=probe.where,
        steps=steps,
        created=any(step.outcome == "created" for step in steps),
        requests=probe.budget.requests,
        elapsed_s=time.monotonic() - started,
    )
    _log.debug("%s", report.summary())
    return report


# -- the three checks ----------------------------------------------------------------------------------------------


@attrs.frozen
class _Answer:
    """One request's outcome: its state, a short detail (a status and code, or a message of ours: never an SDK's
    raw text) and what to chain to the probe's error (an error of ours or a sanitized stand-in)."""

    state: str
    detail: str = ""
    cause: BaseException | None = None
    value: Any = None


@attrs.frozen
class _Target:
    """What the probe needs to know of one kind of store: its first request and the words of its messages."""

    #: ``directory '/x'``, ``container 'c' (account a)``, ``bucket 'b' at http://...``
    what: str
    #: one request: does the root exist and take the credentials (a listing of ``prefix``)
    look: Callable[[str], _Answer]
    #: create the root (``None``: this kind cannot tell a missing root; its ``look`` covers checks 1 and 2)
    create: Callable[[], None] | None
    #: the endpoint, for "unreachable" (``None``: local)
    endpoint: str | None
    #: what to check when the endpoint is unreachable
    endpoint_fix: str
    #: what to check when the credentials are refused (``None``: this kind has none)
    credentials_fix: str | None
    #: what to check when writing, reading or deleting under the job's prefix fails
    write_fix: str
    #: what to do when the root is missing and creating it failed
    create_fix: str = "create it yourself"
    #: how an operator makes a missing root
    make_it: str = "create it"


@attrs.define
class _Budget:
    """Runs each request in attempts on a thread of its own, each bounded by the request timeout and all by the
    probe's deadline; retries the transient answers after a full-jitter backoff, as the resilience layer does."""

    attempts: int
    request_timeout_s: float
    base_delay_s: float
    max_delay_s: float
    budget_s: float
    deadline: float
    requests: int = 0
    rng: random.Random = attrs.field(factory=random.Random)

    @classmethod
    def of(cls, resilience: ResilienceSettings, started: float) -> _Budget:
        attempts = min(resilience.max_attempts, PROBE_MAX_ATTEMPTS)
        first_backoff_s = min(resilience.max_delay_s, resilience.base_delay_s)
        budget_s = attempts * resilience.request_timeout_s + (attempts - 1) * first_backoff_s
        return cls(
            attempts=attempts,
            request_timeout_s=resilience.request_timeout_s,
            base_delay_s=resilience.base_delay_s,
            max_delay_s=resilience.max_delay_s,
            budget_s=budget_s,
            deadline=started + budget_s,
        )

    def run(self, call: Callable[[], _Answer]) -> tuple[_Answer, int]:
        """The first answer that is not transient, or the last one; and the attempts made."""
        answer = _Answer(_NO_ANSWER, f"the probe's time budget of {self.budget_s:.3g} s ran out first")
        made = 0
        for retry in range(self.attempts):
            if retry:
                cap = min(self.max_delay_s, self.base_delay_s * 2 ** (retry - 1))
                time.sleep(min(self.rng.uniform(0, cap), max(0.0, self.deadline - time.monotonic())))
            timeout_s = min(self.request_timeout_s, self.deadline - time.monotonic())
            if timeout_s <= 0:
                break
            made += 1
            self.requests += 1
            answer = _in_thread(call, timeout_s) or _Answer(
                _NO_ANSWER, f"no answer within {timeout_s:.3g} s (blob.store.request.timeout.ms)"
            )
            if answer.state not in _RETRIED:
                break
        return answer, made


@attrs.define
class _Probe:
    store: BlobStore
    target: _Target
    budget: _Budget
    #: ``blob.store.create.if.missing`` (``None``: the store has no such option)
    create: bool | None
    #: the probe blob's name
    name: str

    @property
    def where(self) -> str:
        return redact(self.store.describe())

    def run(self) -> tuple[ProbeStep, ...]:
        steps = list(self._root())
        steps.append(self._write())
        return tuple(steps)

    def _root(self) -> list[ProbeStep]:
        """Checks 1 and 2: one listing of the probe's prefix, and the creation of a missing root."""
        target = self.target
        prefix = self.name.rsplit("/", 1)[0] + "/"
        create = target.create
        if create is None:  # a store that cannot tell a missing root from a refusal: its own validate()
            requests = 0
            if self.create:
                answer, made = self.budget.run(lambda: _ask(_unwrapped(self.store).create_resources))
                requests += made
                if answer.state != _OK:
                    raise self._failure((1, 2), answer, made)
            answer, made = self.budget.run(lambda: target.look(prefix))
            requests += made
            if answer.state != _OK:
                raise self._failure((1, 2), answer, made)
            return [
                ProbeStep(1, "validated by the store", requests),
                ProbeStep(2, "validated with check 1 (the store tells them apart only by its messages)", 0),
            ]
        answer, made = self.budget.run(lambda: target.look(prefix))
        outcome = "exists"
        if answer.state == _MISSING:
            if not self.create:
                raise self._failure(
                    (1,),
                    answer,
                    made,
                    problem=(f"the {target.what} does not exist and blob.store.create.if.missing is false"),
                    fix=(f"{target.make_it}, or set blob.store.create.if.missing=true to let the job create it"),
                )
            created, made_creating = self.budget.run(lambda: _ask(create))
            made += made_creating
            if created.state != _OK:
                raise self._failure(
                    (1,),
                    created,
                    made_creating,
                    problem=(f"the {target.what} does not exist and creating it failed: {created.detail}"),
                    fix=target.create_fix,
                )
            outcome = "created"
        elif answer.state != _OK:
            raise self._failure((1,), answer, made)
        first = ProbeStep(1, outcome, made)
        if target.credentials_fix is None:
            return [first, ProbeStep(2, "not applicable (a file:// store has no credentials)", 0)]
        return [first, ProbeStep(2, "accepted", 0)]  # the listing (or the creation) was answered, not refused

    def _write(self) -> ProbeStep:
        """Check 3: a create-only write, a read back and a delete of the probe blob."""
        name, store = self.name, _unwrapped(self.store)
        started_puts = 0

        def put() -> None:
            nonlocal started_puts
            started_puts += 1
            try:
                store.put(name, _PAYLOAD, create_only=True)
            except AlreadyExistsError:
                if started_puts == 1:
                    raise
                # an earlier attempt's write landed and its reply was lost: the read back tells it is ours

        wrote, made = self.budget.run(lambda: _ask(put))
        requests = made
        if wrote.state != _OK:
            raise self._failure((3,), wrote, made, problem=f"writing the probe blob {name!r} failed: {wrote.detail}")
        read, made = self.budget.run(lambda: _ask(lambda: store.get(name)))
        requests += made
        if read.state != _OK or read.value != _PAYLOAD:
            self._delete_quietly(store)
            detail = read.detail if read.state != _OK else "it read back other bytes than were written"
            raise self._failure((3,), read, made, problem=f"reading back the probe blob {name!r} failed: {detail}")
        deleted, made = self.budget.run(lambda: _ask(lambda: store.delete(name)))
        requests += made
        if deleted.state != _OK:
            raise self._failure(
                (3,),
                deleted,
                made,
                problem=(f"deleting the probe blob {name!r} failed (it is left there): {deleted.detail}"),
            )
        return ProbeStep(3, f"wrote, read back and deleted {name!r}", requests)

    def _delete_quietly(self, store: BlobStore) -> None:
        answer, _made = self.budget.run(lambda: _ask(lambda: store.delete(self.name)))
        if answer.state != _OK:
            _log.warning("the probe blob %r is left in %s: %s", self.name, self.where, answer.detail)

    def _failure(
        self,
        checks: tuple[int, ...],
        answer: _Answer,
        attempts: int,
        *,
        problem: str | None = None,
        fix: str | None = None,
    ) -> StorageError:
        """The probe's error for ``answer``: the check, what was found, what to fix; no secret in it or its chain."""
        target = self.target
        kind: type[StorageError] = StorageError
        endpoint = target.endpoint or "the store"
        if answer.state == _REFUSED and target.credentials_fix is not None:
            checks = (2,)
            problem = f"the service refused the credentials ({answer.detail})"
            fix = target.credentials_fix
        elif answer.state == _UNREACHABLE:
            problem = (
                f"the endpoint {endpoint} is unreachable ({answer.detail}; {attempts} attempts); this is not a "
                "credential problem: no request reached the service"
            )
            fix = target.endpoint_fix
        elif answer.state == _NO_ANSWER:
            problem = (
                f"{endpoint} did not answer ({answer.detail}; {attempts} attempts); this is not a credential problem"
            )
            fix = f"{target.endpoint_fix}; raise blob.store.request.timeout.ms if the service is only slow"
        elif answer.state == _BUSY:
            kind = TransientStorageError
            problem = (
                f"{problem}; each of {attempts} attempts failed transiently"
                if problem
                else f"each of {attempts} attempts failed transiently ({answer.detail})"
            )
            fix = "retry later, and check the service's health"
        elif answer.state == _NOT_A_DIRECTORY:
            problem = answer.detail
            fix = "point blob.store.url at a directory (or remove the file)"
        problem = problem or (f"the service answered {answer.detail}" if target.endpoint else answer.detail)
        fix = fix or (target.write_fix if checks == (3,) else target.endpoint_fix)
        if len(checks) == 1:
            which = f"check {checks[0]} of {len(PROBE_CHECKS)} ({PROBE_CHECKS[checks[0] - 1]})"
        else:
            which = (
                f"checks {checks[0]}-{checks[-1]} of {len(PROBE_CHECKS)} ("
                + " and ".join(PROBE_CHECKS[check - 1] for check in checks)
                + ")"
            )
        error = kind(redact(f"blob store probe of {self.where}: {which} failed: {problem}. To fix: {fix}"))
        error.__cause__ = answer.cause
        error.__suppress_context__ = True
        return scrub_chain(error)


# -- the kinds of stores ---------------------------------------------------------------------------------------


def _target_of(store: BlobStore) -> _Target:
    """The probe's view of ``store``: ``file://``, ``az://`` and ``s3://`` by their own first request, any other
    store by its ``validate()``."""
    inner = _unwrapped(store)
    if isinstance(inner, FileBlobStore):
        return _file_target(inner)
    azure = sys.modules.get("statebackend.blobstores.azure")  # imported when the store was opened, if az://
    if azure is not None and isinstance(inner, azure.AzureBlobStore):
        return _azure_target(inner)
    s3 = sys.modules.get("statebackend.blobstores.s3")
    if s3 is not None and isinstance(inner, s3.S3BlobStore):
        return _s3_target(inner)
    return _Target(
        what=f"store {redact(inner.describe())}",
        look=lambda _prefix: _ask(inner.validate),
        create=None,
        endpoint=None,
        endpoint_fix="check blob.store.url and the store's blob.store.* settings, and that the service is up",
        credentials_fix=None,
        write_fix="check that the credentials may create, read and delete blobs under the job's prefix",
    )


def _file_target(store: FileBlobStore) -> _Target:
    root = store.root

    def look(_prefix: str) -> _Answer:
        try:
            found = os.stat(root)
        except (FileNotFoundError, NotADirectoryError):
            return _Answer(_MISSING)
        except OSError as exc:
            return _Answer(_FAILED, f"cannot inspect {root!r}: {exc.strerror or exc}", sanitized(exc))
        if not stat.S_ISDIR(found.st_mode):
            return _Answer(_NOT_A_DIRECTORY, f"{root!r} exists but is not a directory")
        return _Answer(_OK)

    return _Target(
        what=f"directory {root!r}",
        look=look,
        create=store.create_root,
        endpoint=None,
        endpoint_fix=f"check that {root!r} is reachable (a mounted share) and that this user may read it",
        credentials_fix=None,
        write_fix=(
            f"make {root!r} writable, readable and searchable by this user ({_user()}), or mount it read-write; or "
            "point blob.store.url at a directory this user may write"
        ),
        create_fix=(
            f"create {root!r} yourself (every parent must be a directory), or let this user ({_user()}) create it: "
            "write permission on its parent; or point blob.store.url at another path"
        ),
        make_it="create (or mount) it",
    )


def _azure_target(store: Any) -> _Target:
    """``store`` is an :class:`~statebackend.blobstores.azure.AzureBlobStore`; its SDK client sends the listing."""
    from azure.core import exceptions as azure_errors  # installed: the store is open

    container_client = store._container_client  # private: the status and code its translation folds away
    service = store._service
    endpoint = redact(service.primary_endpoint)

    def look(prefix: str) -> _Answer:
        try:
            pages = container_client.list_blobs(name_starts_with=store._root() + prefix, results_per_page=1)
            next(pages.by_page(), None)
        except Exception as exc:  # noqa: BLE001 - every SDK and stdlib exception is sorted below, none escapes
            return _azure_answer(exc, azure_errors)
        return _Answer(_OK)

    return _Target(
        what=f"container {store.container!r} (account {service.account_name})",
        look=look,
        create=store.create_resources,
        endpoint=endpoint,
        endpoint_fix=(
            "check the endpoint in blob.store.connection.string (BlobEndpoint) or blob.store.account.url (or "
            "AZURE_STORAGE_CONNECTION_STRING), and that the service is up and reachable from here"
        ),
        credentials_fix=(
            "check the account key or SAS in blob.store.connection.string or blob.store.credential (or "
            "AZURE_STORAGE_CONNECTION_STRING); a SAS must be valid now and allow list, read, create, write and "
            "delete"
        ),
        write_fix=(
            "give the credential create, write, read and delete permissions on the container (a SAS with "
            "'racwdl'), and check that the container is not under a lease or a legal hold"
        ),
        create_fix=(
            f"create the container {store.container!r} yourself, or use a credential that may create containers "
            "(the account key, or an account SAS with create permission)"
        ),
    )


def _azure_answer(exc: Exception, azure_errors: Any) -> _Answer:
    status = getattr(exc, "status_code", None)
    code = getattr(exc, "error_code", None)
    code = str(getattr(code, "value", code) or "")
    detail = f"{status} {code}".strip() if status else type(exc).__name__
    cause = sanitized(exc)
    if isinstance(exc, azure_errors.ResourceNotFoundError) and code == "ContainerNotFound":
        return _Answer(_MISSING, detail, cause)
    if isinstance(exc, azure_errors.ClientAuthenticationError) or status == 403:
        return _Answer(_REFUSED, detail, cause)
    if isinstance(exc, azure_errors.ServiceRequestError):  # the request was never sent: no connection
        return _Answer(_UNREACHABLE, f"no connection: {type(exc).__name__}", cause)
    if isinstance(exc, azure_errors.ServiceResponseTimeoutError):
        return _Answer(_NO_ANSWER, f"no answer: {type(exc).__name__}", cause)
    if (
        isinstance(exc, azure_errors.HttpResponseError)
        and status is not None
        and status < 500
        and status
        not in {
            408,
            429,
        }
    ):
        return _Answer(_FAILED, detail, cause)
    return _Answer(_BUSY, detail, cause)  # 408, 429, 5xx, a reply cut short or malformed


def _s3_target(store: Any) -> _Target:
    """``store`` is an :class:`~statebackend.blobstores.s3.S3BlobStore`; its boto3 client sends the listing."""
    import botocore.exceptions as boto_errors  # installed: the store is open

    client = store._client  # private: the status and code its translation folds away
    endpoint = redact(client.meta.endpoint_url)

    def look(prefix: str) -> _Answer:
        try:
            client.list_objects_v2(Bucket=store.bucket, Prefix=store._root() + prefix, MaxKeys=1)
        except Exception as exc:  # noqa: BLE001 - every SDK and stdlib exception is sorted below, none escapes
            return _s3_answer(exc, boto_errors)
        return _Answer(_OK)

    return _Target(
        what=f"bucket {store.bucket!r} at {endpoint}",
        look=look,
        create=store.create_resources,
        endpoint=endpoint,
        endpoint_fix=(
            "check blob.store.endpoint.url (or AWS_ENDPOINT_URL) and blob.store.region, and that the service is up "
            "and reachable from here"
        ),
        credentials_fix=(
            "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), AWS_PROFILE or blob.store.profile, "
            "and that the bucket policy lets these credentials list the bucket"
        ),
        write_fix=(
            f"allow s3:PutObject, s3:GetObject and s3:DeleteObject on {store.bucket}/{store._root()}* for these "
            "credentials (IAM or bucket policy), and check for an object lock or a read-only bucket policy"
        ),
        create_fix=f"create the bucket {store.bucket!r} yourself, or allow s3:CreateBucket for these credentials",
    )


def _s3_answer(exc: Exception, boto_errors: Any) -> _Answer:
    from statebackend.blobstores.s3_replies import AUTH_CODES, TRANSIENT_CODES, error_code

    cause = sanitized(exc)
    if isinstance(exc, boto_errors.ClientError):
        code = error_code(exc)
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        detail = f"{status} {code}".strip()
        if code == "NoSuchBucket" or (status == 404 and code in {"404", "NotFound", ""}):
            return _Answer(_MISSING, detail, cause)
        if code in AUTH_CODES or status == 403:
            return _Answer(_REFUSED, detail, cause)
        if code in TRANSIENT_CODES or status in {408, 429} or status >= 500:
            return _Answer(_BUSY, detail, cause)
        return _Answer(_FAILED, detail, cause)
    if isinstance(exc, (boto_errors.NoCredentialsError, boto_errors.PartialCredentialsError)):
        return _Answer(_REFUSED, f"no usable credentials found: {type(exc).__name__}", cause)
    if isinstance(exc, boto_errors.ReadTimeoutError):
        return _Answer(_NO_ANSWER, f"no answer: {type(exc).__name__}", cause)
    if isinstance(exc, boto_errors.ConnectionError):  # refused, no route, DNS, a connect timeout, a proxy's refusal
        return _Answer(_UNREACHABLE, f"no connection: {type(exc).__name__}", cause)
    if isinstance(exc, boto_errors.BotoCoreError) and not isinstance(exc, boto_errors.HTTPClientError):
        return _Answer(_FAILED, type(exc).__name__, cause)
    return _Answer(_BUSY, type(exc).__name__, cause)  # a read timeout, a reset, a reply cut short


# -- helpers -------------------------------------------------------------------------------------------------------


def _ask(call: Callable[[], Any]) -> _Answer:
    """Run one operation of the store's API: its result, or its error sorted into an answer."""
    try:
        return _Answer(_OK, value=call())
    except AlreadyExistsError as exc:
        return _Answer(_TAKEN, str(exc), exc)
    except TransientStorageError as exc:
        return _Answer(_BUSY, str(exc), exc)
    except StateBackendError as exc:
        return _Answer(_FAILED, str(exc), exc)
    except Exception as exc:  # noqa: BLE001 - a plug-in store's untranslated error: reported, never raised raw
        return _Answer(_FAILED, f"{type(exc).__name__}: {redact(exc)}", sanitized(exc))


def _in_thread(call: Callable[[], _Answer], timeout_s: float) -> _Answer | None:
    """``call()`` on a daemon thread of its own; ``None`` if it has not answered within ``timeout_s`` (the thread is
    left to finish, bounded by the SDK's own socket timeouts, and never keeps the process alive)."""
    answers: queue.Queue[_Answer] = queue.Queue(maxsize=1)

    def attempt() -> None:
        try:
            answers.put(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as an answer
            answers.put(_Answer(_FAILED, type(exc).__name__, sanitized(exc)))

    threading.Thread(target=attempt, name="blob-store-probe", daemon=True).start()
    try:
        return answers.get(timeout=timeout_s)
    except queue.Empty:
        return None


def _unwrapped(store: BlobStore) -> BlobStore:
    """The store below the resilience layer: the probe retries on its own, within its budget."""
    return store.inner if isinstance(store, ResilientBlobStore) else store


def _user() -> str:
    uid = os.geteuid()
    try:
        import pwd
    except ImportError:  # pragma: no cover - not on Windows
        return f"uid {uid}"
    try:
        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except KeyError:  # a uid without a name
        return f"uid {uid}"

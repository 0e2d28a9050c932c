"""Keeping secrets out of everything statebackend prints: messages, reprs, chained causes, logs, CLI output.

One module, used for every URL and message that may quote a service's or an SDK's text:

- :func:`redact` scrubs a text: the values of URL query parameters (a SAS token's ``sig=``, ``se=``, ``sv=``...,
  presigned S3 URLs' ``X-Amz-Signature=``...; only a short list of harmless parameters such as ``restype`` or
  ``comp`` is kept), URL userinfo (``scheme://user:password@``), connection-string fields (``AccountKey=``,
  ``SharedAccessSignature=``, ``SharedAccessKey=``, ``Password=``...), ``Authorization`` header values, and every
  secret registered with :func:`register_secrets` or passed in (also in their URL-encoded forms).
- :func:`credential_secrets` and :func:`connection_string_secrets` name the secrets inside a credential (a string,
  ``AzureSasCredential``, ``AzureNamedKeyCredential``, a ``{"account_name", "account_key"}`` dict) or a connection
  string, so stores can register them when they open.
- :func:`sanitized` builds a :class:`RedactedError` stand-in for an SDK or stdlib exception (its type name and
  scrubbed text, its traceback, a scrubbed chain): translated errors are chained to the stand-in, never to the raw
  exception, whose text may quote a URL with a SAS token. :func:`scrub_chain` replaces any raw exception left in
  an error's ``__cause__``/``__context__`` chain, so ``traceback.format_exception`` prints nothing secret.
- :func:`protect_sdk_loggers` puts a :class:`RedactingFilter` on the loggers of azure-core/azure-storage,
  botocore/boto3, urllib3 and requests (they log request URLs, with a SAS token, at DEBUG), on every such logger
  that exists when a store opens plus a list of the known URL-logging ones. A logger filter does not see records
  of child loggers, hence every logger gets its own.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from typing import Any, TypeVar
from urllib.parse import quote, quote_plus, unquote

from statebackend.errors import RedactedError, StateBackendError

__all__ = [
    "REDACTED",
    "RedactedError",
    "RedactingFilter",
    "connection_string_secrets",
    "credential_secrets",
    "protect_sdk_loggers",
    "redact",
    "register_secrets",
    "sanitized",
    "scrub_chain",
    "url_has_userinfo",
]

REDACTED = "***"

#: query parameters whose values are never secret and help a reader (Azure REST, S3 REST)
_SAFE_QUERY_PARAMS = frozenset(
    {
        "restype", "comp", "prefix", "delimiter", "marker", "maxresults", "include", "blockid", "blocklisttype",
        "list-type", "continuation-token", "start-after", "max-keys", "encoding-type", "uploadid", "partnumber",
        "uploads", "delete", "versionid", "fetch-owner", "timeout", "snapshot", "x-id", "showonly",
    }
)  # fmt: skip

#: parameter names of SAS tokens and presigned URLs, redacted wherever they appear as ``name=value``
_SECRET_PARAMS = (
    r"sig|se|sv|sp|st|spr|srt|ss|sr|si|sdd|skoid|sktid|skt|ske|sks|skv|saoid|suoid|scid|"
    r"x-amz-signature|x-amz-credential|x-amz-security-token|awsaccesskeyid|signature|credential"
)

#: connection-string (and similar ``Key=value;``) fields that hold secrets
_SECRET_FIELDS = (
    r"accountkey|sharedaccesssignature|sharedaccesskey|password|pwd|clientsecret|client_secret|"
    r"aws_secret_access_key|aws_session_token|secretaccesskey|sessiontoken|secret_key|access_key"
)

_QUERY_RE = re.compile(r"([?&])([^=&#\s'\"<>?]+)=([^&#\s'\"<>]*)")
_PARAM_RE = re.compile(rf"(?i)(^|[\s'\"(,;&?])({_SECRET_PARAMS})=([^&#\s'\"<>,;)]*)")
_FIELD_RE = re.compile(rf"(?i)\b({_SECRET_FIELDS})(\s*[=:]\s*['\"]?)([^;'\"\s,}}]*)")
# up to the last '@' before whitespace: a secret may hold '/' (AWS keys do); a path with '@' is over-redacted
_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^\s'\"<>]+)@")
_AUTH_HEADER_RE = re.compile(
    r"(?i)(['\"]?(?:authorization|x-amz-security-token|x-ms-copy-source-authorization|proxy-authorization)['\"]?"
    r"\s*[:=]\s*['\"]?)([^'\"\r\n}]*)"
)
_SHARED_KEY_RE = re.compile(r"(?i)\b(SharedKey(?:Lite)?\s+[\w.-]+:)[A-Za-z0-9+/=]+")

_MIN_SECRET_LENGTH = 8  # shorter strings ("testing") would scrub ordinary words; real secrets are 40+ characters

_registry: set[str] = set()
_registry_lock = threading.Lock()


def register_secrets(secrets: Iterable[str | None]) -> None:
    """Remember secrets for the life of the process: every later :func:`redact` (and the log filter) scrubs them."""
    forms = _forms(secrets)
    if forms:
        with _registry_lock:
            _registry.update(forms)


def _forms(secrets: Iterable[str | None]) -> set[str]:
    forms: set[str] = set()
    for secret in secrets:
        if not isinstance(secret, str):
            continue
        secret = secret.strip()
        if len(secret) < _MIN_SECRET_LENGTH:
            continue
        for form in (secret, secret.lstrip("?"), quote(secret, safe=""), quote_plus(secret), unquote(secret)):
            if len(form) >= _MIN_SECRET_LENGTH:
                forms.add(form)
    return forms


def _redact_query(match: re.Match[str]) -> str:
    lead, name, value = match.groups()
    if name.lower() in _SAFE_QUERY_PARAMS or not value:
        return match.group(0)
    return f"{lead}{name}={REDACTED}"


def redact(text: object, secrets: Iterable[str | None] = ()) -> str:
    """``text`` (any object, as ``str``) with every secret replaced by ``***``: see the module docstring."""
    try:
        result = text if isinstance(text, str) else str(text)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails: say so rather than fail to report
        return f"<{type(text).__name__} without a printable text>"
    with _registry_lock:
        known = set(_registry)
    known |= _forms(secrets)
    for secret in sorted(known, key=len, reverse=True):  # longest first: a connection string before its key
        result = result.replace(secret, REDACTED)
    result = _USERINFO_RE.sub(rf"\1{REDACTED}@", result)
    result = _FIELD_RE.sub(rf"\1\2{REDACTED}", result)
    result = _AUTH_HEADER_RE.sub(rf"\1{REDACTED}", result)
    result = _SHARED_KEY_RE.sub(rf"\1{REDACTED}", result)
    result = _QUERY_RE.sub(_redact_query, result)
    return _PARAM_RE.sub(rf"\1\2={REDACTED}", result)


def url_has_userinfo(url: str) -> bool:
    """Whether ``url`` carries ``user[:password]@`` in its authority (between ``scheme://`` and the next ``/``)."""
    _, sep, rest = url.partition("://")
    return bool(sep) and "@" in rest.split("/", 1)[0]


def connection_string_secrets(connection_string: str | None) -> tuple[str, ...]:
    """The secret values of a connection string (AccountKey, SharedAccessSignature, SharedAccessKey, Password)."""
    if not connection_string:
        return ()
    found = []
    for part in connection_string.split(";"):
        key, _, value = part.partition("=")
        if key.strip().lower() in {"accountkey", "sharedaccesssignature", "sharedaccesskey", "password"} and value:
            found.append(value.strip())
            found.extend(_sas_signatures(value))
    return (connection_string, *found)


def _sas_signatures(token: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"(?:^|[?&])sig=([^&]+)", token.strip())]


def credential_secrets(credential: Any) -> tuple[str, ...]:
    """The secrets inside an Azure (or any) credential: a string (account key or SAS token), a
    ``{"account_name", "account_key"}`` dict, ``AzureSasCredential`` (``.signature``), ``AzureNamedKeyCredential``
    (``.named_key.key``). A token credential (``DefaultAzureCredential``) holds nothing we could print."""
    if credential is None:
        return ()
    if isinstance(credential, str):
        return (credential, *_sas_signatures(credential))
    if isinstance(credential, dict):
        key = credential.get("account_key")
        return (key,) if isinstance(key, str) else ()
    found: list[str] = []
    signature = getattr(credential, "signature", None)
    if isinstance(signature, str):
        found += [signature, *_sas_signatures(signature)]
    named_key = getattr(credential, "named_key", None)
    key = getattr(named_key, "key", None)
    if isinstance(key, str):
        found.append(key)
    account_key = getattr(credential, "account_key", None)
    if isinstance(account_key, str):
        found.append(account_key)
    return tuple(found)


def _is_clean(exc: BaseException) -> bool:
    return isinstance(exc, RedactedError)


def sanitized(exc: BaseException, secrets: Iterable[str | None] = (), _depth: int = 0) -> RedactedError:
    """A :class:`RedactedError` for ``exc`` with its chain (cause, or unsuppressed context) sanitized too."""
    if isinstance(exc, RedactedError):
        return exc
    secrets = tuple(secrets)
    kind = type(exc)
    module = kind.__module__
    type_name = kind.__qualname__ if module in {"builtins", "__main__"} else f"{module}.{kind.__qualname__}"
    text = redact(exc, secrets)
    first_lines = "\n".join(text.splitlines()[:20])
    standin = RedactedError(type_name, first_lines)
    standin.__traceback__ = exc.__traceback__
    following = exc.__cause__ if exc.__cause__ is not None else (None if exc.__suppress_context__ else exc.__context__)
    if following is not None and _depth < 8:
        if isinstance(following, StateBackendError):
            standin.__cause__ = scrub_chain(following, secrets)
        else:
            standin.__cause__ = sanitized(following, secrets, _depth + 1)
    standin.__suppress_context__ = True
    return standin


E = TypeVar("E", bound=BaseException)


def scrub_chain(error: E, secrets: Iterable[str | None] = ()) -> E:
    """Replace every raw (non-statebackend) exception in ``error``'s ``__cause__``/``__context__`` chain by a
    sanitized stand-in, and scrub the texts of statebackend errors in it. Returns ``error`` (changed in place)."""
    secrets = tuple(secrets)
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen or len(seen) > 32:
            continue
        seen.add(id(current))
        if _is_clean(current):
            continue
        if isinstance(current, StateBackendError) and current.args and isinstance(current.args[0], str):
            cleaned = redact(current.args[0], secrets)
            if cleaned != current.args[0]:
                current.args = (cleaned, *current.args[1:])
        cause, context = current.__cause__, current.__context__
        if cause is not None and not isinstance(cause, StateBackendError) and not _is_clean(cause):
            current.__cause__ = cause = sanitized(cause, secrets)
        if context is not None and not isinstance(context, StateBackendError) and not _is_clean(context):
            # a suppressed context (``raise X from Y``) is never printed: drop it rather than keep a raw object
            current.__context__ = None if current.__suppress_context__ else sanitized(context, secrets)
        for link in (current.__cause__, current.__context__):
            if link is not None:
                pending.append(link)
    return error


class RedactingFilter(logging.Filter):
    """Scrubs a record's message, arguments and exception text with :func:`redact` (registered secrets included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record: let logging report it as it would
            return True
        record.msg = redact(message)
        record.args = None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_FILTER = RedactingFilter()
_SDK_LOGGER_PREFIXES = ("azure", "botocore", "boto3", "s3transfer", "urllib3", "requests", "statebackend")
#: loggers known to print request URLs or headers, created here if the SDK has not created them yet
_KNOWN_URL_LOGGERS = (
    "azure.core.pipeline.policies.http_logging_policy",
    "azure.core.pipeline.transport._requests_basic",
    "azure.storage.blob._shared.policies",
    "azure.storage.blob._shared.base_client",
    "azure.identity",
    "urllib3.connectionpool",
    "urllib3.util.retry",
    "botocore.endpoint",
    "botocore.auth",
    "botocore.parsers",
    "botocore.hooks",
    "botocore.httpsession",
    "botocore.retryhandler",
    "botocore.regions",
    "botocore.client",
    "botocore.credentials",
    "boto3.resources.action",
    "statebackend.blobstores.resilience",
    "statebackend.blobstores.azure",
    "statebackend.blobstores.s3",
)


def protect_sdk_loggers(secrets: Iterable[str | None] = ()) -> None:
    """Register ``secrets`` and put the redacting filter on every SDK logger (see the module docstring)."""
    register_secrets(secrets)
    names = set(_KNOWN_URL_LOGGERS)
    names.update(
        name
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if isinstance(logger, logging.Logger) and name.split(".", 1)[0] in _SDK_LOGGER_PREFIXES
    )
    names.update(_SDK_LOGGER_PREFIXES)
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)

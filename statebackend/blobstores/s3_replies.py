"""What the ``s3://`` store (:mod:`statebackend.blobstores.s3`) knows about S3's replies and requests: the error
codes it sorts into transient, not-found and refused, the exceptions of a cut or malformed reply, the check of a
ListObjectsV2 page, the Content-MD5 that DeleteObjects needs on S3-compatible servers, and the registration of the
client's credentials with statebackend.redact. Kept apart so that the store module holds the requests themselves.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
from collections.abc import Mapping
from typing import Any

from statebackend.redact import register_secrets

try:
    import botocore.exceptions as boto_errors
    from botocore.parsers import ResponseParserError
    from urllib3 import exceptions as urllib3_errors
except ImportError as exc:  # pragma: no cover - the registry turns this into an install hint
    raise ImportError("s3:// needs boto3: pip install 'statebackend[s3]'") from exc

__all__ = [
    "AUTH_CODES",
    "MALFORMED_REPLY",
    "NOT_FOUND_CODES",
    "TRANSIENT_BOTO",
    "TRANSIENT_CODES",
    "content_md5",
    "error_code",
    "page_problem",
    "register_credentials",
]

#: error codes of a throttled or failing service: worth a retry
TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "BandwidthLimitExceeded",
}  # fmt: skip
NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
AUTH_CODES = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "AuthorizationHeaderMalformed", "403",
}  # fmt: skip
TRANSIENT_BOTO = (
    boto_errors.ConnectionError,  # connect/read timeouts, refused, closed connections
    boto_errors.HTTPClientError,
    boto_errors.IncompleteReadError,
    boto_errors.ResponseStreamingError,
    boto_errors.ChecksumError,  # a body damaged or cut in transit
    ResponseParserError,  # a reply body botocore could not parse: cut or mangled
)
#: what botocore (or the stdlib under it) lets through for a reply cut inside its head or body
MALFORMED_REPLY = (
    http.client.HTTPException,
    urllib3_errors.HTTPError,
    OSError,
    AttributeError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
)


def content_md5(request: Any, **_: Any) -> None:
    """Give DeleteObjects the Content-MD5 of its body: botocore (1.36 on) sends only a CRC32 header, which
    S3-compatible servers that require Content-MD5 refuse (``MissingContentMD5``): no delete would go through there."""
    body = request.body if isinstance(request.body, bytes) else str(request.body or "").encode()
    request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()


def register_credentials(client: Any) -> None:
    """Register the secret key and session token with statebackend.redact (both appear in botocore's DEBUG logs of
    the canonical request, the token as a header). Refreshable credentials are not touched: reading them could
    trigger a network call at open; their values are still scrubbed by the header and field patterns."""
    try:
        credentials = client._request_signer._credentials  # private: to redact, never to show
    except AttributeError:
        return
    if credentials is not None and not hasattr(credentials, "refresh_needed"):
        register_secrets((getattr(credentials, "secret_key", None), getattr(credentials, "token", None)))


def page_problem(page: Mapping[str, Any], bucket: str, prefix: str, entries: int) -> str | None:
    """Why a ListObjectsV2 page cannot be trusted, or None."""
    missing = [field for field in ("IsTruncated", "KeyCount", "Name") if field not in page]
    if missing:
        return "missing " + ", ".join(missing)
    if page["Name"] != bucket:
        return "another bucket's name"
    if (page.get("Prefix") or "") != prefix:
        return "another prefix"
    if page["KeyCount"] != entries:
        return f"KeyCount {page['KeyCount']} but {entries} entries"
    if page["IsTruncated"] and not page.get("NextContinuationToken"):
        return "truncated without a continuation token"
    return None


def error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))

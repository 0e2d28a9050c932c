"""Secrets never appear: in error messages, reprs, the formatted traceback chain (``__cause__``/``__context__``),
DEBUG logs of statebackend and of the SDKs (azure, urllib3, botocore), or the ``statebackend`` CLI's output; for
every credential form: an account key or a SAS in a connection string, a SAS string, a SAS in the account URL,
``AzureSasCredential``, ``AzureNamedKeyCredential``, an account key string, S3 keys in the URL's userinfo, and the
AWS secret key and session token from the environment. Against the real Azurite and moto, reachable and not."""

from __future__ import annotations

import datetime
import logging
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import pytest
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.cli import main
from statebackend.errors import AlreadyExistsError, ConfigError, NotFoundError, StateBackendError, StorageError
from statebackend.redact import RedactedError, redact, sanitized, scrub_chain
from tests.servers import AZURITE_ACCOUNT_KEY, AZURITE_ACCOUNT_NAME, ServerProcess, free_port

# -- the redaction module itself --------------------------------------------------------------------------------

SIG = "AbCdEf0123456789+/xyzXYZsecretSIG="


@pytest.mark.parametrize(
    "text",
    [
        f"http://h:1/acct/c/b?restype=container&sv=2021-08-06&se=2030-01-01&sp=rwdl&sig={quote(SIG, safe='')}",
        f"sv=2021-08-06&ss=b&srt=sco&sp=rwdlac&se=2030-01-01T00%3A00%3A00Z&sig={SIG}",
        f"BlobEndpoint=http://h/acct;SharedAccessSignature=sv=2021&sig={SIG};",
        f"DefaultEndpointsProtocol=http;AccountName=a;AccountKey={SIG};BlobEndpoint=http://h/a;",
        f"{{'Authorization': 'SharedKey acct:{SIG}', 'x-ms-version': '2021'}}",
        f"s3://AKIAEXAMPLE:{SIG}@bucket/prefix",
        f"Max retries exceeded with url: /acct/c?comp=list&sig={quote_plus(SIG)} (Caused by ...)",
        f"x-amz-security-token:{SIG}",
    ],
)
def test_redact_removes_every_form_of_a_secret(text: str) -> None:
    cleaned = redact(text)
    for form in (SIG, quote(SIG, safe=""), quote_plus(SIG), SIG[:12]):
        assert form not in cleaned, cleaned
    assert "***" in cleaned


def test_redact_keeps_what_helps_a_reader() -> None:
    text = "set blob.store.create.if.missing=true; GET /acct/c?restype=container&comp=list&prefix=a/b"
    assert redact(text) == text


def test_redact_scrubs_secrets_it_is_given() -> None:
    assert redact("the key is s3cr3t-value-42 here", ["s3cr3t-value-42"]) == "the key is *** here"


def test_a_raw_chain_is_replaced_by_sanitized_stand_ins() -> None:
    def failing() -> None:
        try:
            try:
                raise OSError(f"connect to http://h/a?sig={SIG} failed")
            except OSError as inner:
                raise ValueError(f"wrapped: AccountKey={SIG}") from inner
        except ValueError as exc:
            raise StorageError("the store failed") from exc

    with pytest.raises(StorageError) as caught:
        failing()
    error = scrub_chain(caught.value)
    printed = "".join(traceback.format_exception(error))
    assert SIG not in printed and SIG[:12] not in printed
    assert "builtins" not in printed and "ValueError" in printed and "OSError" in printed  # still says what failed
    assert isinstance(error.__cause__, RedactedError) and isinstance(error.__cause__.__cause__, RedactedError)
    assert error.__context__ is None or isinstance(error.__context__, RedactedError)
    assert isinstance(sanitized(KeyError("ContentLength")), RedactedError)


# -- against the real servers -----------------------------------------------------------------------------------


def _sas(account_key: str = AZURITE_ACCOUNT_KEY) -> str:
    return generate_account_sas(
        AZURITE_ACCOUNT_NAME,
        account_key,
        resource_types=ResourceTypes(service=True, container=True, object=True),
        permission=AccountSasPermissions(read=True, write=True, delete=True, list=True, add=True, create=True),
        expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=2),
    )


def _sig(sas: str) -> str:
    return next(part[4:] for part in sas.split("&") if part.startswith("sig="))


def _forms(secret: str) -> list[str]:
    from urllib.parse import unquote

    raw = unquote(secret)
    return sorted({secret, raw, quote(raw, safe=""), quote_plus(raw), raw[:16]})


def _account_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT_NAME}"


def _azure_form(form: str, port: int) -> tuple[dict[str, Any], list[str]]:
    """Options for an endpoint on ``port`` with the credential in ``form``, and the secrets never to print."""
    sas = _sas()
    key_string = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT_NAME};AccountKey={AZURITE_ACCOUNT_KEY};"
        f"BlobEndpoint={_account_url(port)};"
    )
    forms: dict[str, tuple[dict[str, Any], list[str]]] = {
        "connection-string-account-key": ({"connection.string": key_string}, [AZURITE_ACCOUNT_KEY]),
        "connection-string-sas": (
            {"connection.string": f"BlobEndpoint={_account_url(port)};SharedAccessSignature={sas}"},
            [_sig(sas)],
        ),
        "credential-sas-string": ({"account.url": _account_url(port), "credential": sas}, [_sig(sas)]),
        "account-url-with-sas": ({"account.url": f"{_account_url(port)}?{sas}"}, [_sig(sas)]),
        "azure-sas-credential": (
            {"account.url": _account_url(port), "credential": AzureSasCredential(sas)},
            [_sig(sas)],
        ),
        "azure-named-key-credential": (
            {
                "account.url": _account_url(port),
                "credential": AzureNamedKeyCredential(AZURITE_ACCOUNT_NAME, AZURITE_ACCOUNT_KEY),
            },
            [AZURITE_ACCOUNT_KEY],
        ),
        "credential-account-key-string": (
            {"account.url": _account_url(port), "credential": AZURITE_ACCOUNT_KEY},
            [AZURITE_ACCOUNT_KEY],
        ),
    }
    return forms[form]


AZURE_FORMS = [
    "connection-string-account-key",
    "connection-string-sas",
    "credential-sas-string",
    "account-url-with-sas",
    "azure-sas-credential",
    "azure-named-key-credential",
    "credential-account-key-string",
]


def _texts_of(error: BaseException) -> list[str]:
    return [str(error), repr(error), "".join(traceback.format_exception(error))]


def _assert_clean(texts: list[str], secrets: list[str]) -> None:
    for text in texts:
        for secret in secrets:
            for form in _forms(secret):
                assert form not in text, f"{form!r} printed in: {text[:2000]}"


def _exercise(store: BlobStore, reachable: bool) -> list[BaseException]:
    """Operations that succeed, that fail as they should (taken, absent) and, when the endpoint is unreachable,
    that fail for that; returns the errors raised."""
    errors: list[BaseException] = []
    calls: list[Callable[[], object]] = [
        lambda: store.validate(),  # type: ignore[attr-defined]
        lambda: store.put("blob", b"data", create_only=True),
        lambda: store.put("blob", b"other", create_only=True),
        lambda: store.get("blob"),
        lambda: store.get("absent"),
        lambda: list(store.list()),
        lambda: store.head("absent"),
    ]
    for call in calls:
        try:
            call()
        except StateBackendError as exc:
            errors.append(exc)
    if reachable:
        assert [type(e) for e in errors] == [AlreadyExistsError, NotFoundError, NotFoundError]
    else:
        assert len(errors) == len(calls) and all(isinstance(e, StorageError) for e in errors)
    return errors


def _timeout_ms(reachable: bool) -> int:
    """The request timeout: an unreachable loopback port refuses at once, so a short one bounds nothing there; a
    reachable server must answer every call as the test expects, so there it only guards a hang (a slow server on
    a loaded machine, logging at DEBUG, is not a fault)."""
    return 120_000 if reachable else 3000


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every logger at DEBUG: statebackend's, azure's, urllib3's, botocore's."""
    caplog.set_level(logging.DEBUG)
    yield caplog


@pytest.mark.azure
@pytest.mark.parametrize("reachable", [True, False], ids=["reachable", "unreachable"])
@pytest.mark.parametrize("form", AZURE_FORMS)
def test_azure_credentials_never_appear(
    azurite: ServerProcess, debug_logs: pytest.LogCaptureFixture, form: str, reachable: bool
) -> None:
    port = azurite.port if reachable else free_port()
    options, secrets = _azure_form(form, port)
    container = f"t{uuid.uuid4().hex[:20]}"
    if reachable:
        with open_blob_store(f"az://{container}/p", _azure_form("connection-string-account-key", port)[0]) as admin:
            admin.create_resources()  # type: ignore[attr-defined]
    store = open_blob_store(
        f"az://{container}/p",
        {**options, "retry.max.attempts": 2, "retry.base.delay.ms": 1, "request.timeout.ms": _timeout_ms(reachable)},
    )
    try:
        errors = _exercise(store, reachable)
        texts = [text for error in errors for text in _texts_of(error)]
        _assert_clean([*texts, repr(store), store.describe(), debug_logs.text], secrets)
        assert any(record.name.startswith("urllib3") for record in debug_logs.records)  # the SDK really logged
    finally:
        store.close()


@pytest.mark.s3
@pytest.mark.parametrize("reachable", [True, False], ids=["reachable", "unreachable"])
def test_aws_secret_key_and_session_token_never_appear(
    s3_server: ServerProcess, debug_logs: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, reachable: bool
) -> None:
    secret, token = f"aws-secret-{uuid.uuid4().hex}", f"aws-session-token-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAREDACTIONTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    endpoint = s3_server.endpoint if reachable else f"http://127.0.0.1:{free_port()}"
    options = {
        "endpoint.url": endpoint,
        "create.if.missing": True,
        "retry.max.attempts": 2,
        "retry.base.delay.ms": 1,
        "request.timeout.ms": _timeout_ms(reachable),
    }
    store = open_blob_store(f"s3://t-{uuid.uuid4().hex[:20]}/p", options)
    try:
        if reachable:
            store.create_resources()  # type: ignore[attr-defined]
        errors = _exercise(store, reachable)
        texts = [text for error in errors for text in _texts_of(error)]
        _assert_clean([*texts, repr(store), store.describe(), debug_logs.text], [secret, token])
        assert any(record.name.startswith("botocore") for record in debug_logs.records)
    finally:
        store.close()


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAEXAMPLEKEY:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@bucket/p",
        "s3://AKIAEXAMPLEKEY:wJalrXUtnFEMI/K7MDENGbPxRfiCYEXAMPLEKEY@bucket/p",
        "az://user:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@container/p",
        "az://container/p?sv=2021&sig=wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY",
    ],
)
def test_credentials_in_the_url_are_refused_without_echoing_them(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        open_blob_store(
            url,
            {"endpoint.url": "http://127.0.0.1:9"}
            if url.startswith("s3")
            else _azure_form("connection-string-account-key", 9)[0],
        )
    _assert_clean(_texts_of(caught.value), ["wJalrXUtnFEMIK7MDENG", "AKIAEXAMPLEKEY"])
    assert "blob.store.url" in str(caught.value)


# -- the CLI -----------------------------------------------------------------------------------------------------


def _cli(tmp_path: Path, config: dict[str, str], *args: str) -> tuple[int, str]:
    path = tmp_path / f"job-{uuid.uuid4().hex[:8]}.properties"
    path.write_text("".join(f"{key}={value}\n" for key, value in config.items()))
    return main([args[0], str(path), *args[1:]]), ""


@pytest.mark.azure
@pytest.mark.parametrize(
    "form", ["connection-string-sas", "account-url-with-sas", "credential-sas-string", "connection-string-account-key"]
)
@pytest.mark.parametrize("command", [("validate",), ("checkpoints", "task-0")])
def test_cli_output_never_shows_a_credential(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str, command: tuple[str, ...]
) -> None:
    options, secrets = _azure_form(form, free_port())  # unreachable: every command fails and says why
    config = {f"blob.store.{key}": str(value) for key, value in options.items()}
    config.update(
        {
            "blob.store.url": f"az://t{uuid.uuid4().hex[:20]}/p",
            "blob.store.retry.max.attempts": "1",
            "blob.store.request.timeout.ms": "2000",
            "stores.counts.backup.factories": "changelog",
        }
    )
    status, _ = _cli(tmp_path, config, *command)
    out, err = capsys.readouterr()
    assert status != 0 and err.startswith("statebackend:")
    _assert_clean([out, err], secrets)


def test_cli_refuses_a_url_with_userinfo_without_echoing_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"blob.store.url": "s3://AKIAEXAMPLEKEY:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@bucket/p"}
    status, _ = _cli(tmp_path, config, "checkpoints", "task-0")
    out, err = capsys.readouterr()
    assert status == 3  # a configuration error (docs/operations.md, exit codes)
    _assert_clean([out, err], ["wJalrXUtnFEMIK7MDENG"])

"""Blob store options in the configuration follow the URL's scheme: an option of another scheme is an error naming
the scheme that takes it, a misspelled one gets a suggestion, and a store's ranges are the config's."""

from __future__ import annotations

import pytest

from statebackend.blobstores.resilience import ResilienceSettings
from statebackend.errors import ConfigError
from tests.test_config import AZ_URL, S3_URL, URL, error_of, settings

# -- blob store options follow the URL's scheme -----------------------------------------------------------------


def test_a_blob_store_option_of_another_scheme_is_an_error_naming_the_scheme_that_takes_it() -> None:
    message = error_of({"blob.store.url": AZ_URL, "blob.store.endpoint.url": "http://127.0.0.1:9000"})
    assert message.startswith("blob.store.endpoint.url: not an option of az:// blob stores")
    assert "taken by s3:// only" in message
    retry = error_of({"blob.store.url": URL, "blob.store.retry.max.attempts": 3})
    assert "blob.store.retry.max.attempts: not an option of file:// blob stores" in retry
    assert "taken by az://, s3:// only" in retry


def test_a_bad_azure_account_url_is_refused_by_config_without_echoing_it() -> None:
    # its query may be a SAS: the spec checks it (once, at config time) and never shows it
    for bad in ("https://user:sekrit@acct.blob.core.windows.net/", "ftp://acct/?sig=sekrit", "  "):
        message = error_of({"blob.store.url": AZ_URL, "blob.store.account.url": bad})
        assert (
            "blob.store.account.url='<not echoed>' is not valid: not an http(s) URL without user:password@" in message
        )
        assert "sekrit" not in message
    account_url = "https://acct.blob.core.windows.net/?sv=1&sig=abc"
    assert (
        settings(blob__store__url=AZ_URL, blob__store__account__url=account_url).blob_store_options["account.url"]
        == account_url
    )


def test_a_misspelled_blob_store_option_still_gets_did_you_mean() -> None:
    message = error_of({"blob.store.url": URL, "blob.store.create.if.mising": "false"})
    assert "blob.store.create.if.mising: unknown key; did you mean blob.store.create.if.missing?" in message


def test_hedge_max_has_one_range_in_config_and_in_the_store() -> None:
    # seen: config allowed 1 to 8, the resilience layer's own parser 0 and up
    assert "blob.store.hedge.max=0 is not valid: out of range" in error_of(
        {"blob.store.url": S3_URL, "blob.store.hedge.max": 0}
    )
    with pytest.raises(ConfigError, match="blob.store.hedge.max=0 is not valid: out of range"):
        ResilienceSettings.from_options({"hedge.max": 0})
    assert ResilienceSettings.from_options({"hedge.max": "3"}).max_hedges == 3

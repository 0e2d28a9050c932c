"""The nonce trailer (statebackend.recordfile.nonce): every write of a blob that may be written again under its name
carries bytes of its own, so a store whose version is a digest of the bytes (S3's ETag, the MD5) gives a rewrite a
new version, and a sweep's conditional delete judged before the rewrite keeps it. Here: the trailer in both formats
(record file version 4, env base version 2), its renewal, its damage, and rewrites on moto's S3 server through the
backends' own rewrite paths."""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Any

import attrs
import pytest
from statebackend.backends.blobsnapshot.format import content_hash, run_name

from statebackend import envbase
from statebackend import recordfile as fmt
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CorruptDataError
from statebackend.recordfile import FileHeader, content_of, encode, iter_records, renew_nonce, verify
from statebackend.recordfile.nonce import NONCE_SIZE
from statebackend.task import TaskStorage
from tests.backend_helpers import blobsnapshot_config, blobsnapshot_manager, fill
from tests.test_delete_many import server_store
from tests.test_envbase import check_binding, filled_store, write_base

DELTA = FileHeader(
    kind="delta", job="j", task="t", store="s", checkpoint_id="1-1", token="tok", seq=3, base_seq=2, format_version=4
)
RECORDS: list[tuple[bytes, bytes | None]] = [(b"a", b"1"), (b"b", None), (b"c", b"x" * 300)]


def test_two_writes_of_the_same_records_differ_in_their_nonce_only() -> None:
    first, second = encode(DELTA, RECORDS), encode(DELTA, RECORDS)
    assert first != second, "two writes of one file must not be the same bytes"
    assert bytes(content_of(first)) == bytes(content_of(second)) == first[: -fmt.TRAILER_SIZE]
    assert first[-fmt.TRAILER_SIZE : -fmt.TRAILER_SIZE + NONCE_SIZE] != second[-fmt.TRAILER_SIZE : -24]
    for data in (first, second):
        assert verify(data, name="d") == DELTA
        assert list(iter_records(data, name="d")) == RECORDS
        assert list(iter_records(io.BytesIO(data), name="d")) == RECORDS


def test_an_older_version_has_no_trailer_and_its_content_is_all_its_bytes() -> None:
    data = encode(attrs.evolve(DELTA, format_version=3), RECORDS)
    assert bytes(content_of(data)) == data and encode(attrs.evolve(DELTA, format_version=3), RECORDS) == data


def test_two_env_bases_of_one_version_differ_in_their_nonce_only(tmp_path: Path) -> None:
    with filled_store(tmp_path / "a", 300) as local:
        first = write_base(local, tmp_path / "one")
        second = write_base(local, tmp_path / "two")
    assert first != second and bytes(content_of(first)) == bytes(content_of(second))
    blobs = MemoryBlobStore()
    for name, data in (("one", first), ("two", second)):
        blobs.put(name, data)
        header = envbase.restore_env_base(envbase.BlobSource(blobs, name, len(data)), None, check=check_binding())
        assert header.format_version == 2 and header.records == 300


def test_renewing_the_nonce_gives_new_bytes_of_the_same_content(tmp_path: Path) -> None:
    path = tmp_path / "delta"
    path.write_bytes(encode(DELTA, RECORDS))
    before = path.read_bytes()
    assert renew_nonce(path, aside=tmp_path)
    after = path.read_bytes()
    assert after != before and len(after) == len(before)
    assert bytes(content_of(after)) == bytes(content_of(before))
    assert list(iter_records(after, name="renewed")) == RECORDS
    assert [p.name for p in tmp_path.iterdir()] == ["delta"], "nothing left aside"


def test_a_file_without_a_trailer_is_not_renewed(tmp_path: Path) -> None:
    path = tmp_path / "old"
    data = encode(attrs.evolve(DELTA, format_version=3), RECORDS)
    path.write_bytes(data)
    assert not renew_nonce(path)
    assert path.read_bytes() == data


def test_every_damage_to_the_trailer_is_refused_and_never_renewed(tmp_path: Path) -> None:
    data = encode(DELTA, RECORDS, compression="none")
    for at in range(len(data) - fmt.TRAILER_SIZE, len(data)):
        damaged = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]
        with pytest.raises(CorruptDataError):
            verify(damaged, name="f")
        with pytest.raises(CorruptDataError):
            list(iter_records(io.BytesIO(damaged), name="f"))
        path = tmp_path / "damaged"
        path.write_bytes(damaged)
        if damaged.endswith(b"SBNONCE\x00"):  # a damaged end marker: not a trailer, nothing renewed
            with pytest.raises(CorruptDataError, match="nonce trailer fails its checksum"):
                renew_nonce(path)
    for cut in (1, NONCE_SIZE, fmt.TRAILER_SIZE, fmt.TRAILER_SIZE + 1):
        with pytest.raises(CorruptDataError):
            verify(data[:-cut], name="cut")


# ------------------------------------------------------------------------------------------------- rewrites on S3


@pytest.mark.s3
@pytest.mark.parametrize("format_version", [4, 3], ids=["v4-trailer", "v3-older-release"])
def test_on_s3_a_refreshed_run_keeps_its_name_and_restores(
    tmp_path: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch, format_version: int
) -> None:
    """blob-snapshot's refresh of a run no durable index names (``RunUpload.put_run``) keeps the run's name.

    Version 4 (this release): the refresh renews the nonce, so on S3 the rewrite has an ETag of its own. Version 3 (no
    trailer: as an older release wrote and cached it) cannot have its nonce renewed: its refresh sends the same bytes,
    as that release did, and the commit goes on (failing it would fail every retry of a task that restored such runs).
    Either way the run is named by its content and restores."""
    from statebackend.backends.blobsnapshot import upload

    if format_version == 3:
        monkeypatch.setattr(upload, "FileHeader", functools.partial(FileHeader, format_version=3))
    blobs = server_store("s3", s3_server)
    try:
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(blobsnapshot_config(tmp_path), "task-0", blob_store=blobs) as task:
            fill(task, model, 0, 300, "a")
            task.commit_durably({"input": "0"})
            manager = blobsnapshot_manager(task)
            state = manager.shared.stores["counts"]
            run = state.runs[-1]
            name = run_name(state.prefix, run.hash)
            before = blobs.get(name)
            assert (bytes(content_of(before)) == before) is (format_version == 3), "only version 4 has a trailer"
            etag = blobs.head(name).etag
            # uploaded by this manager: a refresh (as of a run no durable index names, older than half the grace)
            assert run.hash in state.uploaded
            assert manager.uploader.put_run(state, run, state.cached(run))
            data = blobs.get(name)
            if format_version == 4:
                assert blobs.head(name).etag not in (None, etag), "a rewrite on S3 must have an ETag of its own"
                assert len(data) == run.size and content_hash(content_of(data)) == run.hash
            else:
                assert blobs.head(name).etag == etag and data == before
            fill(task, model, 300, 350, "b")
            task.commit_durably({"input": "1"})
        with TaskStorage.open(blobsnapshot_config(tmp_path, "again"), "task-0", blob_store=blobs) as task:
            assert dict(task.store("counts").items()) == model
    finally:
        blobs.close()


@pytest.mark.s3
def test_on_s3_a_delta_written_again_gets_a_new_etag(tmp_path: Path, s3_server: Any) -> None:
    """A staged delta sent again under its name (changelog's re-send of a delta whose earlier try landed long ago)
    renews its nonce first: S3 gives the rewrite another ETag."""
    blobs = server_store("s3", s3_server)
    try:
        staged = tmp_path / "000000000003-tok.delta"
        staged.write_bytes(encode(DELTA, RECORDS))
        blobs.put_file("d/delta", staged, create_only=True)
        etags = {blobs.head("d/delta").etag}
        for _ in range(2):
            assert renew_nonce(staged)
            blobs.put_file("d/delta", staged)
            etags.add(blobs.head("d/delta").etag)
        assert len(etags) == 3 and None not in etags
        assert list(iter_records(blobs.get("d/delta"), name="d/delta")) == RECORDS
    finally:
        blobs.close()

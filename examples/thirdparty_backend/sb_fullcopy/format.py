"""The full-copy blob: one store's whole content at one checkpoint, checksummed and bound to its name.

Name: ``<job>/<task>/<store>/<factory>/<checkpoint id, zero-padded>-<token>.full`` (the prefix is
``BackendContext.blob_prefix``; the zero-padded id sorts like the id, so a listing is in checkpoint order). The
name is the marker written into the checkpoint.

Layout, all integers big-endian::

    magic     8 bytes   b"SBFULL01"
    hlen      4 bytes   length of the header
    header    hlen      UTF-8 JSON: format, job, task, store, checkpoint_id, token, records
    records   ...       per record: key length (4), key, value length (4), value; keys strictly ascending
    digest    32 bytes  SHA-256 of everything above

``decode`` checks the digest before it parses anything, then the header, the record count, the key order and that
nothing trails the records; any failure is a :class:`CorruptDataError` naming the blob. ``check_binding`` checks the
header against the name it was read from and the task asking, so a blob can never stand in for another.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable

import attrs
from statebackend.checkpoint import CheckpointId

from statebackend.errors import ConfigError, CorruptDataError, IncompatibleFormatError
from statebackend.store import LocalVersion

__all__ = ["FORMAT_VERSION", "Header", "blob_name", "check_binding", "decode", "encode", "parse_blob_name"]

MAGIC = b"SBFULL01"
FORMAT_VERSION = 1
_DIGEST_SIZE = 32
_U32 = struct.Struct(">I")
_NAME_RE = re.compile(r"(\d{15})-(\d{6})-([0-9a-f]+)\.full")


@attrs.frozen
class Header:
    """What a blob says about itself."""

    job: str
    task: str
    store: str
    checkpoint_id: str
    token: str
    records: int

    @property
    def version(self) -> LocalVersion:
        return LocalVersion(self.checkpoint_id, self.token)


def blob_name(prefix: str, version: LocalVersion) -> str:
    """The blob (and marker) for the state at ``version`` under ``prefix``."""
    return f"{prefix}{CheckpointId.parse(version.checkpoint_id).sortable()}-{version.token}.full"


def parse_blob_name(prefix: str, name: str) -> LocalVersion | None:
    """The version a blob name under ``prefix`` stands for, or ``None`` if it is not one of ours."""
    if not name.startswith(prefix):
        return None
    match = _NAME_RE.fullmatch(name[len(prefix) :])
    if match is None:
        return None
    try:
        checkpoint_id = CheckpointId(int(match.group(1)), int(match.group(2)))
    except (ValueError, TypeError, ConfigError):
        return None
    return LocalVersion(str(checkpoint_id), match.group(3))


def encode(header: Header, items: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The blob for ``items`` (sorted, as a read view yields them). ``header.records`` is filled in here."""
    body = bytearray()
    count = 0
    for key, value in items:
        body += _U32.pack(len(key)) + key + _U32.pack(len(value)) + value
        count += 1
    header_json = json.dumps(
        {"format": FORMAT_VERSION, **attrs.asdict(attrs.evolve(header, records=count))}, sort_keys=True
    ).encode()
    data = MAGIC + _U32.pack(len(header_json)) + header_json + bytes(body)
    return data + hashlib.sha256(data).digest()


def decode(data: bytes, *, name: str) -> tuple[Header, list[tuple[bytes, bytes]]]:
    """Verify blob ``name`` and return its header and records; :class:`CorruptDataError` names it on any damage."""
    if len(data) < len(MAGIC) + _U32.size + _DIGEST_SIZE or not data.startswith(MAGIC):
        raise CorruptDataError(f"blob {name} is not a full-copy blob (bad magic or cut short: {len(data)} bytes)")
    payload, digest = data[:-_DIGEST_SIZE], data[-_DIGEST_SIZE:]
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptDataError(
            f"blob {name} failed its SHA-256 check ({len(data)} bytes): damaged or cut short in "
            "the blob store; nothing of it was loaded"
        )
    offset = len(MAGIC)
    (header_len,) = _U32.unpack_from(payload, offset)
    offset += _U32.size
    try:
        fields = json.loads(payload[offset : offset + header_len])
        version = fields.pop("format")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptDataError(f"blob {name}: unreadable header") from exc
    if version != FORMAT_VERSION:
        raise IncompatibleFormatError(f"blob {name} has format {version!r}; this backend reads {FORMAT_VERSION}")
    try:
        header = Header(**fields)
    except TypeError as exc:
        raise CorruptDataError(f"blob {name}: header fields {sorted(fields)} are not this format's") from exc
    offset += header_len
    records: list[tuple[bytes, bytes]] = []
    previous: bytes | None = None
    try:
        while offset < len(payload):
            key, offset = _read_field(payload, offset)
            value, offset = _read_field(payload, offset)
            if previous is not None and key <= previous:
                raise CorruptDataError(f"blob {name}: keys are not strictly ascending")
            records.append((key, value))
            previous = key
    except struct.error as exc:
        raise CorruptDataError(f"blob {name}: a record runs past the end") from exc
    if len(records) != header.records:
        raise CorruptDataError(f"blob {name}: holds {len(records)} records, its header says {header.records}")
    return header, records


def check_binding(header: Header, *, name: str, prefix: str, job: str, task: str, store: str) -> None:
    """The blob says it is exactly what its name and the asking task expect, or :class:`CorruptDataError`."""
    try:
        own_name = blob_name(prefix, header.version)
    except ConfigError:  # a checkpoint id that is not one
        own_name = None
    expected = (job, task, store, own_name)
    found = (header.job, header.task, header.store, name)
    if found != expected:
        raise CorruptDataError(
            f"blob {name} holds the state of job {header.job!r} task {header.task!r} store {header.store!r} at "
            f"{header.checkpoint_id}/{header.token}, not what its name and task {task!r} store {store!r} say: "
            "it was copied or renamed and was not loaded"
        )


def _read_field(data: bytes, offset: int) -> tuple[bytes, int]:
    (size,) = _U32.unpack_from(data, offset)
    start = offset + _U32.size
    end = start + size
    if end > len(data):
        raise struct.error("field past the end")
    return data[start:end], end

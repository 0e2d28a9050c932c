"""Serdes: how typed keys and values become the bytes the local store keeps.

A ``Serde`` has a ``name`` (the value of ``stores.<name>.key.serde`` / ``stores.<name>.msg.serde``), ``to_bytes`` and
``from_bytes``; ``from_bytes(to_bytes(x)) == x`` for every accepted ``x``. The named ones (:mod:`.builtin`):

- ``bytes``: identity (``bytes`` only).
- ``string``: UTF-8 (``str`` only). Byte order equals code point order and prefixes stay prefixes.
- ``integer``: signed 64-bit big-endian with the sign bit flipped, so byte order equals numeric order and range
  scans over integer keys work.
- ``json``: compact, sorted keys, UTF-8, so equal values give equal bytes (keys must be deterministic).
- ``pickle``: opt-in only: never a default, used only when named explicitly, because unpickling runs code and pickled
  bytes are not stable across Python versions. Only for state this job alone writes.

And for values only, ``record:<module>:<Class>`` (:mod:`.record`): instances of an attrs class, dataclass or
NamedTuple, stored compactly under the fingerprint of the class's schema, so values written under an earlier shape
of the class (a field added with a default, one dropped, ``int`` widened to ``float``) read as the current one.

Whatever a serde cannot encode raises :class:`SerdeError` (nothing is written): a Python type it does not take (a
``str`` for ``integer``, a ``Decimal`` or a ``set`` in JSON; such a ``SerdeError`` is also the ``TypeError`` it always
was), or a value of the right type it cannot represent (a string with a lone surrogate, a float NaN in JSON, an int
over 64 bits, an unpicklable object). Its message names the serde and the type and says how to fix it; a typed store
view (``statebackend.store.typed``) raises it again at the offending call with the store and the key. Bytes that
cannot be decoded raise ``CorruptDataError``.
Whole arrays: ``encode_many(serde, objs)`` and ``decode_many(serde, datas)`` convert a sequence in one call, with the
same results and errors as ``to_bytes`` / ``from_bytes`` item by item (the first bad item raises, naming it as the
per-item call does). The built-in serdes do it with their ``to_bytes_many`` / ``from_bytes_many`` (type checks and
packing over the whole array; ``string`` and ``bytes`` also take an Arrow string / binary array without a Python
call per item); any other serde is called item by item. Arrow arrays (anything with ``to_pylist``) are accepted by
every serde; a null in one is refused like ``None``; numpy arrays and pandas Series are taken as their ``tolist()``.
``prefix_preserving`` says whether ``to_bytes(p)`` being a prefix of ``to_bytes(k)`` follows from ``p`` being a prefix
of ``k``; typed prefix iteration needs it.
"""

from __future__ import annotations

from statebackend.serdes.builtin import (
    SERDE_NAMES,
    BytesSerde,
    IntegerSerde,
    JsonSerde,
    PickleSerde,
    Serde,
    StringSerde,
    decode_many,
    encode_many,
    named_serde,
)
from statebackend.serdes.record import (
    RECORD,
    RECORD_PREFIX,
    RecordSchema,
    RecordSerde,
    is_record,
    record_class,
    record_serde,
)

__all__ = [
    "RECORD",
    "RECORD_PREFIX",
    "SERDE_NAMES",
    "BytesSerde",
    "IntegerSerde",
    "JsonSerde",
    "PickleSerde",
    "RecordSchema",
    "RecordSerde",
    "Serde",
    "StringSerde",
    "decode_many",
    "encode_many",
    "get_serde",
    "is_record",
    "record_class",
    "record_serde",
]


def get_serde(name: str) -> Serde:
    """The serde ``name`` says: one of ``SERDE_NAMES``, or ``record:<module>:<Class>`` (a :class:`RecordSerde` of
    that class knowing its current schema only); ``ConfigError`` saying what is allowed otherwise."""
    if is_record(name):
        return record_serde(name)
    return named_serde(name)

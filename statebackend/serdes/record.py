"""The record serde: values that are instances of a class (attrs, dataclass or NamedTuple), stored compactly under
the fingerprint of their schema, so a value written under an earlier shape of the class reads as the current one.

Contract:

- **Schema.** A record class's schema is its ``__init__`` fields in declaration order, each ``name:type`` with
  ``type`` one of ``int`` (signed 64-bit), ``float`` (64-bit), ``bool``, ``str``, ``bytes`` or ``json`` (a ``list`` or
  ``dict`` annotation: any JSON value), and ``?`` after it when the annotation allows ``None``
  (``count:int,last:str?``). Its fingerprint is the first 4 bytes of the SHA-256 of that text: the same in every
  process and task, whatever the class is called, so values copied between tasks (a rescale) keep their meaning.
- **Value bytes.** ``0xA1``, the 4-byte fingerprint of the schema it was written with, then one ``struct`` (little
  endian): a bitmap of the optional fields that are ``None``, the fixed-size fields in field order (``q``, ``d``,
  ``?``), the byte length of each variable-size field (``I``), then those fields' bytes (UTF-8, raw, compact JSON).
  No field names: a value of ``count:int,total:float,name:str`` costs 5 + 8 + 8 + 4 + len(name) bytes.
- **Reading old values.** :class:`RecordSerde` knows the schemas a store's values may have been written with (the
  checkpoint records them, ``serdes[store]["msg.schemas"]``). A value of an older schema is read as the current
  class when every change is one of: a field added with a default (it takes the default), a field dropped (its
  bytes are skipped), ``int`` widened to ``float``, a scalar widened to ``json``, a required field made optional.
  Any other change (a type narrowed or changed, an optional field made required, a field added without a default)
  is refused at open by :func:`read_problems`, naming the field; the way out is a migration
  (:mod:`statebackend.values`), which rewrites every value once.
- **Errors.** ``to_bytes`` of anything but an instance of the class, of a field of the wrong Python type (``None``
  in a required field, a ``bool`` in an ``int`` field; such a :class:`SerdeError` is also a ``TypeError``), of an
  ``int`` outside 64 bits, a string with a lone surrogate or a ``json`` field that is not JSON raises
  :class:`SerdeError` naming the field. Bytes of an unknown fingerprint, or damaged bytes, raise
  :class:`CorruptDataError`.

Speed: encoders and decoders are generated per schema (as attrs and dataclasses generate ``__init__``): one
``struct`` call per value, attribute reads and type checks inline. ``python -m bench.values`` compares it with the
``json`` serde of the same values as dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import json.encoder
import json.scanner
import keyword
import re
import struct
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import attrs

from statebackend.errors import ConfigError, CorruptDataError, SerdeError
from statebackend.serdes.builtin import _as_list, cannot_encode, described, json_reason, type_name

__all__ = [
    "FIELD_TYPES",
    "RECORD",
    "RECORD_PREFIX",
    "Field",
    "RecordClass",
    "RecordDicts",
    "RecordSchema",
    "RecordSerde",
    "import_named",
    "is_record",
    "read_problems",
    "record_class",
    "record_serde",
    "schemas_from_text",
    "schemas_to_text",
]

#: the serde name a checkpoint records for a record store (``serdes[store]["msg"]``)
RECORD = "record"
#: ``stores.<name>.msg.serde = record:<module>:<Class>``
RECORD_PREFIX = "record:"
FIELD_TYPES = ("int", "float", "bool", "str", "bytes", "json")

_TAG = b"\xa1"  # record format 1
_HEAD = 5  # the tag and the fingerprint
_FIXED = {"int": "q", "float": "d", "bool": "?"}
_SCALARS = ("int", "float", "bool", "str")
#: (written, read): type changes an old value reads through
_WIDENINGS = {("int", "float")} | {(scalar, "json") for scalar in _SCALARS}
_MAX_OPTIONAL = 64
_BITMAP = {8: "B", 16: "H", 32: "I", 64: "Q"}
_SPEC = re.compile(r"record:([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)")
_FIELD = re.compile(r"([A-Za-z_]\w*):(" + "|".join(FIELD_TYPES) + r")(\??)")


def is_record(serde_name: str) -> bool:
    """Whether ``serde_name`` (a ``msg.serde`` value) names a record class."""
    return isinstance(serde_name, str) and serde_name.startswith(RECORD_PREFIX)


@attrs.frozen
class Field:
    """One field of a schema: its name, its type (one of :data:`FIELD_TYPES`), and whether it may be ``None``."""

    name: str
    type: str
    nullable: bool = False

    @property
    def text(self) -> str:
        return f"{self.name}:{self.type}{'?' if self.nullable else ''}"


@attrs.frozen
class RecordSchema:
    """The fields a value was written with, in order. Compared, hashed and recorded by its :attr:`text`."""

    fields: tuple[Field, ...]

    @property
    def text(self) -> str:
        """``name:type[?],...``: what checkpoints record and the fingerprint is computed from."""
        return ",".join(f.text for f in self.fields)

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """The first 4 bytes of the SHA-256 of :attr:`text`: written in front of every value of this schema."""
        return hashlib.sha256(self.text.encode("utf-8")).digest()[:4]

    @classmethod
    def parse(cls, text: str) -> RecordSchema:
        """The schema a checkpoint recorded as ``text``; :class:`CorruptDataError` if it is not one."""
        fields = []
        for part in text.split(",") if text else []:
            match = _FIELD.fullmatch(part)
            if match is None:
                raise CorruptDataError(f"record schema {text!r}: {part!r} is not a field name:type[?]")
            fields.append(Field(match[1], match[2], match[3] == "?"))
        if len({f.name for f in fields}) != len(fields):
            raise CorruptDataError(f"record schema {text!r} names a field twice")
        return cls(tuple(fields))


@attrs.frozen
class RecordClass:
    """A record class as the serde reads and builds it: its schema, the ``__init__`` keyword of each field, and
    which fields have a default (an old value without them takes it)."""

    spec: str
    cls: type
    schema: RecordSchema
    init_names: tuple[str, ...]
    has_default: tuple[bool, ...]
    #: every field may be passed by position, in field order (none is keyword-only)
    positional: bool = False


def record_class(spec: str) -> RecordClass:
    """The record class ``record:<module>:<Class>`` names (imported once per process); :class:`ConfigError` saying
    what to fix when it cannot be imported or is no record class with supported field types."""
    return _record_class(spec)


def record_serde(spec: str) -> RecordSerde:
    """A :class:`RecordSerde` of the class ``spec`` names that knows its current schema only (a store's
    :class:`~statebackend.task.TaskStorage` gives the one that also reads the schemas its checkpoint recorded)."""
    return _record_serde(spec)


def import_named(spec: str, what: str) -> Any:
    """The object ``<module>:<qualified name>`` names, imported; :class:`ConfigError` naming ``what`` and saying what
    to fix. The module must be importable wherever the tasks run (under Spark: on every executor)."""
    module_name, _, qualname = spec.strip().partition(":")
    if not module_name or not qualname:
        raise ConfigError(f"{what} {spec!r}: write <module>:<name>, e.g. myjob.values:Count")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{what} {spec}: module {module_name!r} cannot be imported ({exc}); it must be importable "
            "wherever the tasks run (under Spark: on every executor)"
        ) from None
    for part in qualname.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{what} {spec}: module {module_name!r} has no {qualname!r}")
    return target


def read_problems(writer: RecordSchema, reader: RecordClass) -> list[str]:
    """Why values written with ``writer`` cannot be read as ``reader`` (empty: they can), one line per field."""
    written = {f.name: f for f in writer.fields}
    problems = []
    for field, has_default in zip(reader.schema.fields, reader.has_default, strict=True):
        old = written.get(field.name)
        if old is None:
            if not has_default:
                problems.append(
                    f"field {field.name!r} is new and has no default: values written without it have "
                    "nothing to fill it with; give it a default"
                )
            continue
        if old.type != field.type and (old.type, field.type) not in _WIDENINGS:
            problems.append(
                f"field {field.name!r} was {old.type} and is {field.type} now: only int -> float and a "
                "scalar -> json read old values"
            )
        if old.nullable and not field.nullable:
            problems.append(f"field {field.name!r} was optional and is required now: stored values may hold None")
    return problems


def schemas_to_text(schemas: Iterable[RecordSchema]) -> str:
    """What a checkpoint records of a store's schemas: compact JSON ``{fingerprint hex: schema text}``."""
    return json.dumps({s.fingerprint.hex(): s.text for s in schemas}, sort_keys=True, separators=(",", ":"))


def schemas_from_text(text: str, *, where: str = "checkpoint") -> tuple[RecordSchema, ...]:
    """The schemas :func:`schemas_to_text` wrote; :class:`CorruptDataError` naming ``where`` if the text is damaged
    (not that JSON, or a fingerprint that is not its schema's)."""
    try:
        recorded = json.loads(text)
    except ValueError as exc:
        raise CorruptDataError(f"{where}: the recorded record schemas are not JSON ({exc})") from None
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise CorruptDataError(f"{where}: the recorded record schemas are not an object of strings: {text!r}")
    schemas = []
    for fingerprint, schema_text in sorted(recorded.items()):
        schema = RecordSchema.parse(schema_text)
        if schema.fingerprint.hex() != fingerprint:
            raise CorruptDataError(
                f"{where}: record schema {schema_text!r} is recorded under fingerprint "
                f"{fingerprint}, but its fingerprint is {schema.fingerprint.hex()}: it was altered"
            )
        schemas.append(schema)
    return tuple(schemas)


class RecordSerde:
    """Instances of one record class <-> bytes; reads values of every schema it knows (see the module docstring).

    ``schemas``: earlier schemas the store's values may have been written with (a checkpoint's record); the class's
    own is always known. A schema the class cannot read (:func:`read_problems`) makes reading its values an error,
    not the construction: a migration reads them another way."""

    prefix_preserving: ClassVar[bool] = False

    def __init__(self, record: RecordClass, schemas: Iterable[RecordSchema] = ()) -> None:
        self.record = record
        self.name = record.spec
        known = {record.schema.fingerprint: record.schema}
        for schema in schemas:
            if known.setdefault(schema.fingerprint, schema) != schema:
                raise CorruptDataError(
                    f"record schemas {known[schema.fingerprint].text!r} and {schema.text!r} have "
                    f"the same fingerprint {schema.fingerprint.hex()}: rename a field of one"
                )
        self.schemas: Mapping[bytes, RecordSchema] = types.MappingProxyType(known)
        self._encode = _encoder(record)
        self._decoders: dict[bytes, Callable[[bytes], Any]] = {
            _TAG + fp: _decoder(schema, record) for fp, schema in known.items()
        }

    def __repr__(self) -> str:
        return f"RecordSerde({self.name!r}, {len(self.schemas)} schema(s))"

    @property
    def schema(self) -> RecordSchema:
        """The schema values are written with: the class's."""
        return self.record.schema

    def with_schemas(self, schemas: Iterable[RecordSchema]) -> RecordSerde:
        """This serde, knowing ``schemas`` too."""
        return RecordSerde(self.record, (*self.schemas.values(), *schemas))

    def to_bytes(self, obj: Any) -> bytes:
        return self._encode(obj)

    def from_bytes(self, data: bytes) -> Any:
        return _read(self._decoders, self.name, data if data.__class__ is bytes else bytes(data))

    def to_bytes_many(self, objs: Any) -> list[bytes]:
        encode = self._encode
        return [encode(obj) for obj in _as_list(objs)]

    def from_bytes_many(self, datas: Sequence[bytes]) -> list[Any]:
        decoders, name = self._decoders, self.name
        return [_read(decoders, name, data if data.__class__ is bytes else bytes(data)) for data in datas]


class RecordDicts:
    """Reads values of the given schemas as dicts ``{field: value}`` of the schema each was written with: what a
    migration gets when the class they were written with may be gone. Reading only."""

    name: ClassVar[str] = RECORD
    prefix_preserving: ClassVar[bool] = False

    def __init__(self, schemas: Iterable[RecordSchema]) -> None:
        self._decoders = {_TAG + s.fingerprint: _decoder(s, None) for s in schemas}

    def to_bytes(self, obj: Any) -> bytes:
        raise cannot_encode(RECORD, obj, "RecordDicts only reads old values; write with the store's RecordSerde")

    def from_bytes(self, data: bytes) -> dict[str, Any]:
        result: dict[str, Any] = _read(self._decoders, RECORD, data if data.__class__ is bytes else bytes(data))
        return result


# -- classes ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _record_class(spec: str) -> RecordClass:
    match = _SPEC.fullmatch(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise ConfigError(
            f"{spec!r} does not name a record class: write record:<module>:<Class>, e.g. record:myjob.values:Count"
        )
    target = import_named(f"{match[1]}:{match[2]}", "record class")
    if not isinstance(target, type):
        raise ConfigError(f"{spec}: {match[2]!r} is a {type(target).__name__}, not a class")
    return _describe(spec, target)


@functools.lru_cache(maxsize=256)
def _record_serde(spec: str) -> RecordSerde:
    return RecordSerde(_record_class(spec))


def _describe(spec: str, cls: type) -> RecordClass:
    """The RecordClass of ``cls``: its init fields, their types from the annotations, their defaults."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # noqa: BLE001 - a name an annotation uses that cannot be resolved, of any kind
        raise ConfigError(f"{spec}: the annotations of {cls.__qualname__} cannot be resolved ({exc!r})") from None
    members: list[tuple[str, str, bool]]  # (attribute, init keyword, has a default)
    if attrs.has(cls):
        init = [a for a in attrs.fields(cls) if a.init]
        members = [(a.name, a.alias or a.name, a.default is not attrs.NOTHING) for a in init]
        positional = not any(a.kw_only for a in init)
    elif dataclasses.is_dataclass(cls):
        fields_ = [f for f in dataclasses.fields(cls) if f.init]
        members = [
            (f.name, f.name, f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
            for f in fields_
        ]
        positional = not any(f.kw_only is True for f in fields_)
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        defaults = getattr(cls, "_field_defaults", {})
        members = [(name, name, name in defaults) for name in cls._fields]
        positional = True
    else:
        raise ConfigError(
            f"{spec}: {cls.__qualname__} is not an attrs class, a dataclass or a NamedTuple; a record "
            "class is one of them, its fields annotated"
        )
    if not members:
        raise ConfigError(f"{spec}: {cls.__qualname__} has no fields")
    fields = []
    for name, _, _ in members:
        if name not in hints:
            raise ConfigError(f"{spec}: field {name!r} of {cls.__qualname__} has no type annotation")
        if keyword.iskeyword(name) or not name.isidentifier():
            raise ConfigError(f"{spec}: field name {name!r} cannot be stored")
        type_name, nullable = _field_type(spec, name, hints[name])
        fields.append(Field(name, type_name, nullable))
    if sum(f.nullable for f in fields) > _MAX_OPTIONAL:
        raise ConfigError(f"{spec}: more than {_MAX_OPTIONAL} optional fields")
    return RecordClass(
        spec=spec,
        cls=cls,
        schema=RecordSchema(tuple(fields)),
        init_names=tuple(init for _, init, _ in members),
        has_default=tuple(default for _, _, default in members),
        positional=positional,
    )


def _field_type(spec: str, name: str, hint: Any) -> tuple[str, bool]:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(hint)
        present = [a for a in args if a is not type(None)]
        if len(present) == 1:
            type_name, _ = _field_type(spec, name, present[0])
            return type_name, len(present) < len(args)
    simple = {int: "int", float: "float", bool: "bool", str: "str", bytes: "bytes", list: "json", dict: "json"}
    found = simple.get(origin if origin in (list, dict) else hint) if isinstance(hint, type) or origin else None
    if found is None:
        raise ConfigError(
            f"{spec}: field {name!r} is annotated {hint!r}; a record field is int, float, bool, str, "
            "bytes, list[...] or dict[...] (stored as JSON), or one of them | None"
        )
    return found, False


# -- generated encoders and decoders -----------------------------------------------------------------------------


@attrs.frozen
class _Layout:
    """Where each field of a schema is in the bytes: the struct, the bit of each optional field, the fixed and the
    variable-size fields in order."""

    schema: RecordSchema
    unpack: struct.Struct
    pack: struct.Struct
    bits: Mapping[str, int]
    fixed: tuple[Field, ...]
    variable: tuple[Field, ...]

    @classmethod
    def of(cls, schema: RecordSchema) -> _Layout:
        optional = [f.name for f in schema.fields if f.nullable]
        bitmap = next((code for size, code in _BITMAP.items() if len(optional) <= size), "Q") if optional else ""
        fixed = tuple(f for f in schema.fields if f.type in _FIXED)
        variable = tuple(f for f in schema.fields if f.type not in _FIXED)
        body = bitmap + "".join(_FIXED[f.type] for f in fixed) + "I" * len(variable)
        return cls(
            schema,
            struct.Struct("<" + body),
            struct.Struct(f"<{_HEAD}s" + body),
            {name: 1 << i for i, name in enumerate(optional)},
            fixed,
            variable,
        )


@functools.lru_cache(maxsize=1024)
def _encoder(record: RecordClass) -> Callable[[Any], bytes]:
    layout = _Layout.of(record.schema)
    fields = record.schema.fields
    lines = [
        "def encode(obj):",
        "    if not isinstance(obj, CLS):",
        "        raise _not_instance(obj)",
        "    try:",
        "        bm = 0",
    ]
    for i, field in enumerate(fields):
        value = f"v{i}"
        lines.append(f"        {value} = obj.{field.name}")
        convert = (
            [f"{value} = _json({value}, F{i}, obj)"]
            if field.type == "json"
            else [f"if {value}.__class__ is not {field.type}: {value} = _{field.type}({value}, F{i}, obj)"]
        )
        if field.type == "str":
            convert.append(f"{value} = {value}.encode()")
        placeholder = "0" if field.type in ("int", "float") else "False" if field.type == "bool" else "b''"
        if field.nullable:
            lines += [
                f"        if {value} is None:",
                f"            bm |= {layout.bits[field.name]}",
                f"            {value} = {placeholder}",
                "        else:",
                *(f"            {statement}" for statement in convert),
            ]
        else:
            lines += [f"        {statement}" for statement in convert]
    index = {f.name: i for i, f in enumerate(fields)}
    args = (
        ["HEAD"]
        + (["bm"] if layout.bits else [])
        + [f"v{index[f.name]}" for f in layout.fixed]
        + [f"len(v{index[f.name]})" for f in layout.variable]
    )
    packed = f"PACK({', '.join(args)})"
    tail = "".join(f" + v{index[f.name]}" for f in layout.variable)
    lines += [
        f"        return {packed}{tail}",
        "    except (struct.error, UnicodeEncodeError, OverflowError) as exc:",
        "        raise _failed(obj, exc) from exc",
    ]
    namespace: dict[str, Any] = {
        "CLS": record.cls,
        "HEAD": _TAG + record.schema.fingerprint,
        "PACK": layout.pack.pack,
        "struct": struct,
        "_int": _int,
        "_float": _float,
        "_bool": _bool,
        "_str": _str,
        "_bytes": _bytes,
        "_json": _json,
        "_not_instance": lambda obj: cannot_encode(
            record.spec,
            obj,
            f"it stores {record.cls.__qualname__} instances, got {type(obj).__name__}: build a "
            f"{record.cls.__qualname__} from it, or declare another msg.serde for this store",
        ),
        "_failed": functools.partial(_encode_failure, record),
        **{f"F{i}": (record.spec, f"field {f.name!r}") for i, f in enumerate(fields)},
    }
    return _compiled("\n".join(lines), namespace, "encode", record.spec)


@functools.lru_cache(maxsize=1024)
def _decoder(writer: RecordSchema, reader: RecordClass | None) -> Callable[[bytes], Any]:
    """A function reading values written with ``writer`` as ``reader`` (None: as a dict of ``writer``'s fields); one
    that raises naming the problems when ``reader`` cannot read them."""
    if reader is not None:
        problems = read_problems(writer, reader)
        if problems:
            message = (
                f"{reader.spec} cannot read values written with schema {writer.fingerprint.hex()} "
                f"({writer.text}): " + "; ".join(problems)
            )

            def refuse(data: bytes) -> Any:
                raise ConfigError(message)

            return refuse
    layout = _Layout.of(writer)
    names = ["bm"] if layout.bits else []
    names += [f"f_{f.name}" for f in layout.fixed] + [f"n_{f.name}" for f in layout.variable]
    wanted = {f.name for f in reader.schema.fields} if reader is not None else {f.name for f in writer.fields}
    start = _HEAD + layout.unpack.size
    end = " + ".join([str(start), *(f"n_{f.name}" for f in layout.variable)])
    lines = [
        "def decode(data):",
        f"    {', '.join(names)}{',' if len(names) == 1 else ''} = UNPACK(data, {_HEAD})",
        f"    if {end} != len(data):",
        f"        raise _length(data, {end})",
        f"    p = {start}",
    ]
    for field in layout.variable:
        lines.append(f"    e = p + n_{field.name}")
        if field.name in wanted:
            read = {"str": "data[p:e].decode()", "bytes": "data[p:e]", "json": "_loads(data[p:e])"}[field.type]
            if field.nullable:
                read = f"None if bm & {layout.bits[field.name]} else {read}"
            lines.append(f"    f_{field.name} = {read}")
        lines.append("    p = e")

    def value(field: Field, target: str) -> str:
        expression = f"float(f_{field.name})" if (field.type, target) == ("int", "float") else f"f_{field.name}"
        if field.nullable and field.type in _FIXED:  # a variable-size field's None is read as such above
            return f"(None if bm & {layout.bits[field.name]} else {expression})"
        return expression

    written = {f.name: f for f in writer.fields}
    if reader is None:
        items = ", ".join(f"{f.name!r}: {value(f, f.type)}" for f in writer.fields)
        lines.append(f"    return {{{items}}}")
    else:
        if reader.positional and all(f.name in written for f in reader.schema.fields):  # faster than keywords
            arguments = ", ".join(value(written[f.name], f.type) for f in reader.schema.fields)
        else:
            arguments = ", ".join(
                f"{init}={value(written[f.name], f.type)}"
                for f, init in zip(reader.schema.fields, reader.init_names, strict=True)
                if f.name in written
            )
        lines.append(f"    return CLS({arguments})")
    namespace: dict[str, Any] = {
        "UNPACK": layout.unpack.unpack_from,
        "_loads": _json_value,
        "CLS": reader.cls if reader is not None else None,
        "_length": lambda data, end: CorruptDataError(
            f"record value of schema {writer.fingerprint.hex()} ({writer.text}) is {len(data)} bytes but its fields "
            f"say {end}: it is damaged"
        ),
    }
    return _compiled("\n".join(lines), namespace, "decode", writer.text)


def _compiled(source: str, namespace: dict[str, Any], name: str, what: str) -> Callable[..., Any]:
    code = compile(source, f"<record {name} of {what}>", "exec")
    exec(code, namespace)  # noqa: S102 - generated from validated field names and a fixed set of types
    function: Callable[..., Any] = namespace[name]
    return function


def _read(decoders: Mapping[bytes, Callable[[bytes], Any]], name: str, data: bytes) -> Any:
    decode = decoders.get(data[:_HEAD])
    if decode is None:
        if data[:1] != _TAG or len(data) < _HEAD:
            raise CorruptDataError(f"{name}: stored value {data[:16]!r} is not a record value")
        raise CorruptDataError(
            f"{name}: stored value was written with record schema {data[1:_HEAD].hex()}, which this reader does not "
            f"know (it knows {', '.join(k[1:].hex() for k in decoders)}): read the store through TaskStorage.store, "
            "which knows every schema its checkpoint recorded"
        )
    try:
        return decode(data)
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptDataError(
            f"{name}: stored value of record schema {data[1:_HEAD].hex()} is damaged ({exc})"
        ) from None


def _encode_failure(record: RecordClass, obj: Any, exc: BaseException) -> Exception:
    for field in record.schema.fields:
        value = getattr(obj, field.name)
        if field.type == "int" and isinstance(value, int) and not -(1 << 63) <= value < (1 << 63):
            return cannot_encode(
                record.spec,
                obj,
                f"field {field.name!r}: {value} is outside the signed 64-bit range; declare it float, or str",
            )
        if field.type == "str" and isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return cannot_encode(
                    record.spec,
                    obj,
                    f"field {field.name!r}: {value[:40]!r} has a lone surrogate; "
                    "strings must be valid Unicode to be stored as UTF-8 (decode the input with "
                    "errors='replace'), or declare the field bytes",
                )
    return cannot_encode(record.spec, obj, f"{type(exc).__name__}: {exc}")


#: (the record serde's name, "field 'name'"): where a generated encoder's field check is
_Where = tuple[str, str]


def _refused(where: _Where, obj: Any, value: Any, expected: str) -> SerdeError:
    spec, field = where
    if value is None:
        return cannot_encode(spec, obj, f"{field} is not optional (annotate it '{expected} | None' to allow None)")
    return cannot_encode(
        spec, obj, f"{field} takes {expected}, got {type_name(value)}: convert it, or change the field's annotation"
    )


def _int(value: Any, where: _Where, obj: Any) -> int:
    if isinstance(value, bool) or value is None:
        raise _refused(where, obj, value, "int")
    if isinstance(value, int):
        return int(value)
    if hasattr(value, "__index__") and type(value).__module__ == "numpy":
        return int(value.__index__())
    raise _refused(where, obj, value, "int")


def _float(value: Any, where: _Where, obj: Any) -> float:
    if isinstance(value, bool) or value is None:
        raise _refused(where, obj, value, "float")
    if isinstance(value, (int, float)) or type(value).__module__ == "numpy":
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise _refused(where, obj, value, "float")


def _bool(value: Any, where: _Where, obj: Any) -> bool:
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise _refused(where, obj, value, "bool")


def _str(value: Any, where: _Where, obj: Any) -> str:
    if isinstance(value, str):
        return value
    raise _refused(where, obj, value, "str")


def _bytes(value: Any, where: _Where, obj: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise _refused(where, obj, value, "bytes")


def _json_encoder() -> Callable[[Any], str]:
    """Compact JSON with sorted keys, no NaN, as the ``json`` serde writes it. ``json.dumps`` builds an encoder at
    every call (about 2.5 us of a small list's 3); the C encoder it builds is made once here when there is one."""
    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    iterencode = make(None, encoder.default, json.encoder.encode_basestring, None, ":", ",", True, False, False)
    return lambda value: "".join(iterencode(value, 0))


_JSON_ENCODE = _json_encoder()
#: json.loads without its checks of the input's encoding and whitespace (typeshed types the argument wrongly)
_JSON_SCAN = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _json(value: Any, where: _Where, obj: Any) -> bytes:
    if value is None:
        raise _refused(where, obj, value, "a JSON value")
    try:
        return _JSON_ENCODE(value).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise cannot_encode(
            where[0],
            obj,
            f"{where[1]}: cannot encode {described(type_name(value))} as JSON ({json_reason(value, exc)})",
        ) from exc


def _json_value(data: bytes) -> Any:
    text = data.decode("utf-8")
    try:
        value, end = _JSON_SCAN(text, 0)
    except StopIteration:
        raise json.JSONDecodeError("no JSON value", text, 0) from None
    if end != len(text):
        raise json.JSONDecodeError("extra data after the JSON value", text, end)
    return value

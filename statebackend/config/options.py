"""Option specs and value parsers (re-exported: they live in :mod:`statebackend.options`, below every part, so the
blob stores declare their options with them without importing config)."""

from __future__ import annotations

from statebackend.options import (
    OptionSpec,
    Parser,
    parse_bool,
    parse_bytes,
    parse_choice,
    parse_duration_ms,
    parse_int,
    parse_list,
    parse_object,
    parse_one,
    parse_options,
    parse_path,
    parse_str,
    value_error,
)

__all__ = [
    "OptionSpec",
    "Parser",
    "parse_bool",
    "parse_bytes",
    "parse_choice",
    "parse_duration_ms",
    "parse_int",
    "parse_list",
    "parse_object",
    "parse_one",
    "parse_options",
    "parse_path",
    "parse_str",
    "value_error",
]

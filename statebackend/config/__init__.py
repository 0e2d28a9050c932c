"""Configuration: flat Samza-style keys parsed once into typed, validated :class:`Settings`.

Contract:

- Every key statebackend owns is declared once here as an :class:`OptionSpec` (parser, default, one-line doc),
  except the ``blob.store.*`` options, which each blob store declares in its class's ``options`` (config validates
  them against the schema of the URL's scheme; an option of another scheme is an error naming the schemes that take
  it); a backend declares its own keys in ``StateBackendFactory.options`` and they are read under
  ``<canonical-factory-name>.<option>`` (only for factories some store names, so a missing optional backend never
  breaks a config that does not use it), and for one store under ``stores.<name>.<canonical-factory-name>.<option>``,
  which overrides the job-wide key for that store (statebackend.config.backend_keys;
  ``Settings.backend_options_for(factory, store=name)``).
- Values may be strings (as a properties file or Spark conf gives them) or already-typed Python values; a ``None``
  value counts as unset. A bool is never accepted where a number is expected.
- A wrong value names the key, the bad value and what is allowed. An unknown key under a prefix statebackend owns
  (``job.``, ``state.``, ``blob.store.``, ``stores.<name>.``, ``task.``, ``metrics.``, ``<used-factory>.``) is an
  error with a "did you mean" for typos, so a misspelled key never silently falls back to its default. Keys under
  other prefixes (``spark.*``, another system's) are kept in ``raw`` and ignored, except a near miss of one of our
  keys (``tsak.commit.ms``), which is reported as a typo.
- All problems are collected and raised as one :class:`~statebackend.errors.ConfigError`: its first line is the
  first problem, and each problem has its own line, so a user fixes everything in one go.
- Settings are immutable and picklable (they travel to Spark executors); their repr hides credentials.
- Each default is written once, in the schema: no attribute of :class:`Settings` has a default of its own, and an
  attribute read from one key says so (:func:`config_keys`), so an unset key gives exactly its spec's default.
- The ``blob.store.*`` options are parsed here, once, by the URL's store class
  (``Settings.blob_store_options``, :class:`ParsedOptions`); the store and its resilience layer use them as they are.
- Job, task and store names follow one rule, :func:`check_name` (statebackend.config.names).

The reference of every key is docs/configuration.md; tests/test_config.py checks it lists every key declared here.
"""

from __future__ import annotations

from statebackend.config.keys import GLOBAL_OPTIONS, SERDES, STORE_OPTIONS
from statebackend.config.names import NAME_ALLOWED, NAME_MAX_LENGTH, NAME_PATTERN, check_name, parse_name
from statebackend.config.properties import load_config
from statebackend.config.settings import Settings, StoreSettings, config_keys
from statebackend.options import (
    OptionSpec,
    ParsedOptions,
    Parser,
    default_of,
    parse_bool,
    parse_bytes,
    parse_choice,
    parse_duration_ms,
    parse_float,
    parse_int,
    parse_list,
    parse_object,
    parse_path,
    parse_str,
)

__all__ = [
    "GLOBAL_OPTIONS",
    "NAME_ALLOWED",
    "NAME_MAX_LENGTH",
    "NAME_PATTERN",
    "SERDES",
    "STORE_OPTIONS",
    "OptionSpec",
    "ParsedOptions",
    "Parser",
    "Settings",
    "StoreSettings",
    "check_name",
    "config_keys",
    "default_of",
    "load_config",
    "parse_bool",
    "parse_bytes",
    "parse_choice",
    "parse_duration_ms",
    "parse_float",
    "parse_int",
    "parse_list",
    "parse_name",
    "parse_object",
    "parse_path",
    "parse_str",
]

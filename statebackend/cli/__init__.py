"""The ``statebackend`` command: look at, check, restore and clean up a job's state on its blob store.

    statebackend validate    job.properties                check the config and the blob store of every backend
    statebackend jobs        job.properties                jobs on the blob store
    statebackend tasks       job.properties                the job's tasks, their newest checkpoint
    statebackend stores      job.properties TASK           a task's stores and their backends
    statebackend checkpoints job.properties TASK           a task's durable checkpoints, with times and sizes
    statebackend inspect     job.properties TASK           one checkpoint: offsets, markers, recipes, bytes
    statebackend verify      job.properties TASK           download and check every blob a checkpoint needs
    statebackend restore     job.properties TASK DIR       restore a task's stores into DIR (pre-warm a machine)
    statebackend dump        job.properties TASK STORE     a store's state at a checkpoint, as JSON lines
    statebackend gc          job.properties                job-level garbage: a dry run unless --apply

A config file holds ``key=value`` lines (``#`` comments), the same flat keys as in Python; ``-D key=value``
overrides (before or after the command). Every line printed goes through statebackend.redact (no SAS token, account
key, URL userinfo or secret field is ever shown); an unexpected exception is one redacted line, never a traceback.
Exit codes: see :data:`EXIT_CODES` (docs/operations.md lists them too).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import textwrap
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from statebackend.cli._common import (
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PIPE,
    EXIT_USAGE,
    Run,
)
from statebackend.config import load_config
from statebackend.errors import ConfigError, NotFoundError, StateBackendError, UsageError
from statebackend.redact import redact

__all__ = ["EXIT_CODES", "exit_codes_help", "load_properties", "main"]

#: exit code -> meaning (documented in docs/operations.md)
EXIT_CODES = {
    0: "success (verify: every marker checked and sound)",
    1: "failure: the blob store refused or failed, data is corrupt or inconsistent, or an unexpected error",
    2: "usage error: an unknown command or option, a missing or malformed argument",
    3: "configuration error: the config file cannot be read, a key or value is wrong",
    4: "not found: no such task, checkpoint or store on the blob store",
    5: "verify: a checkpoint failed its check (a blob missing, damaged or not the one its marker names)",
    6: "verify: nothing failed, but a backend cannot verify its markers (those markers were not checked)",
    130: "interrupted (Ctrl-C): what was done before stays done (a gc --apply may have deleted part of its list)",
    141: "the output pipe was closed by the reader (e.g. `| head`); nothing is reported",
}


#: the earlier name of :func:`statebackend.config.load_config`, the one reader of a config file (the same function)
load_properties = load_config


def exit_codes_help(width: int = 79) -> str:
    """The help's list of exit codes: each code once, on its own line, with its whole meaning (wrapped, indented)."""
    lines = ["exit codes:"]
    for code, meaning in EXIT_CODES.items():
        lines += textwrap.wrap(meaning, width=width, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
    return "\n".join(lines)


def _version() -> str:
    try:
        return version("statebackend")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "unknown"


def _common_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Options every command takes, before or after the command name. Given after it, they must not reset what
    was given before: the subcommand's copies default to SUPPRESS (and -D collects into its own list)."""
    keep: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument(
        "-D",
        dest="overrides" if top else "overrides_after",
        action="append",
        default=[] if top else argparse.SUPPRESS,
        metavar="KEY=VALUE",
        help="override a config key",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table", **keep)
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (there are none when stderr is not a terminal)",
        **keep,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO to stderr", **keep)


def build_parser() -> argparse.ArgumentParser:
    # the raw formatter keeps the epilog's lines: one exit code per line (the default one reflows them into one)
    parser = argparse.ArgumentParser(
        prog="statebackend",
        description=__doc__.split("\n\n")[0],
        epilog=exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"statebackend {_version()}")
    _common_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, *positionals: tuple[str, str]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", help="the job's config file (key=value lines)")
        for positional, what in positionals:
            p.add_argument(positional, help=what)
        _common_options(p, top=False)
        return p

    command("validate", "check the config and every backend's blob store (a write/read/delete probe)")
    command("jobs", "list the jobs on the blob store")
    tasks = command("tasks", "list a job's tasks (the config's job.name unless --job)")
    tasks.add_argument("--job", help="another job on the same blob store")
    command("stores", "list a task's stores and their backends", ("task", "the task name, e.g. task-0"))
    command("checkpoints", "list a task's durable checkpoints, newest last", ("task", "the task name"))
    checkpoint_help = "the checkpoint: its seq (#, as `checkpoints` shows), its id, or 'latest' (default)"
    inspect = command(
        "inspect", "show one checkpoint: offsets, serdes, each backend's marker described", ("task", "the task name")
    )
    verify = command(
        "verify", "download and check every blob a checkpoint needs, without applying it", ("task", "the task name")
    )
    verify.add_argument("--store", action="append", help="check only this store (repeatable)")
    restore = command(
        "restore",
        "restore a task's stores into a local directory (pre-warm a machine)",
        ("task", "the task name"),
        ("directory", "the state.local.dir to restore into"),
    )
    dump = command(
        "dump",
        "print a store's state at a checkpoint as JSON lines (read-only)",
        ("task", "the task name"),
        ("store", "the store name"),
    )
    dump.add_argument("--raw", action="store_true", help="keys and values as base64 of their bytes, not decoded")
    for p in (inspect, verify, restore, dump):
        p.add_argument("-c", "--checkpoint", default="latest", help=checkpoint_help)
    gc = command("gc", "find the job's garbage on the blob store; a dry run unless --apply")
    gc.add_argument("--apply", action="store_true", help="delete what the report lists (default: report only)")
    gc.add_argument(
        "--drop-task",
        action="append",
        metavar="TASK",
        help="collect this task whole, checkpoints "
        "included (a job that now runs fewer tasks; stop it first); repeatable",
    )
    gc.add_argument(
        "--grace",
        default="24h",
        help="leave alone what is younger than this (default 24h), e.g. 6h, "
        "90min; below the backends' gc.grace.period.ms (or 0) a running job's next commit may lose "
        "blobs: warned about, and --apply refuses it without --force",
    )
    gc.add_argument(
        "--force",
        action="store_true",
        help="with --apply: delete even with an unsafe --grace (every writer of the job is stopped)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader closed the pipe (`| head`): stop quietly; stdout goes to /dev/null so the interpreter's final
        # flush does not complain either
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2) print their own text
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    args.overrides = [*args.overrides, *getattr(args, "overrides_after", [])]
    if not args.verbose:
        return _run(args)
    logger = logging.getLogger("statebackend")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return _run(args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _RedactingFormatter(logging.Formatter):
    """Log lines of ``-v`` go through redact, like everything else the command prints."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def _run(args: argparse.Namespace) -> int:
    from statebackend.cli import commands, gc

    handlers = {**commands.COMMANDS, "gc": gc.gc}
    try:
        config = load_config(args.config)
        for override in args.overrides:
            key, sep, value = override.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"-D {override!r}: expected KEY=VALUE, e.g. -D job.name=clicks")
            config[key.strip()] = value.strip()
        with Run.open(args, config) as run:
            return handlers[args.command](run)
    except BrokenPipeError:
        raise
    except UsageError as exc:
        _error(f"statebackend: {exc}")
        return EXIT_USAGE
    except ConfigError as exc:
        _error(f"statebackend: configuration error: {exc}")
        return EXIT_CONFIG
    except NotFoundError as exc:
        _error(f"statebackend: not found: {exc}")
        return EXIT_NOT_FOUND
    except StateBackendError as exc:
        _error(f"statebackend: {type(exc).__name__}: {exc}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        _error("statebackend: interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - one redacted line; a raw traceback could quote a credential
        _error(f"statebackend: unexpected {type(exc).__name__}: {exc}")
        return EXIT_FAILURE
    return EXIT_OK  # pragma: no cover - every command returns its code


def _error(message: str) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):  # stderr closed: nowhere left to say it
        print(redact(message), file=sys.stderr)

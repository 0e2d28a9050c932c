"""The ``statebackend`` command: inspect and validate a job's state from its configuration.

    statebackend validate  job.properties            check the config and the blob store of every backend
    statebackend checkpoints job.properties TASK     list a task's durable checkpoints (newest last)
    statebackend dump job.properties TASK STORE      print a store's state at the newest checkpoint (key<TAB>value)

A config file holds ``key=value`` lines (``#`` comments), the same flat keys as in Python; ``-D key=value`` overrides.
Exit status: 0 on success, 2 on a configuration error, 1 on any other failure, with a one-line message. Every line
printed goes through statebackend.redact (no SAS token, account key, URL userinfo or secret field is ever shown); an
unexpected exception is reported as one redacted line too, never as a raw traceback.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

from statebackend.errors import ConfigError, StateBackendError
from statebackend.redact import redact

__all__ = ["load_properties", "main"]


def load_properties(path: str | Path) -> dict[str, str]:
    """Read a ``key=value`` properties file; a line without ``=`` is a ConfigError naming the line."""
    config: dict[str, str] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "!")):
            continue
        key, sep, value = stripped.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{path}:{number}: expected key=value, got {stripped!r}")
        config[key.strip()] = value.strip()
    return config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statebackend", description=__doc__.split("\n\n")[0])
    parser.add_argument("-D", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="check the config and every backend's blob store")
    validate.add_argument("config")
    checkpoints = sub.add_parser("checkpoints", help="list a task's durable checkpoints")
    checkpoints.add_argument("config")
    checkpoints.add_argument("task")
    dump = sub.add_parser("dump", help="print a store's state at the newest checkpoint")
    dump.add_argument("config")
    dump.add_argument("task")
    dump.add_argument("store")
    args = parser.parse_args(argv)
    try:
        config = load_properties(args.config)
        for override in args.overrides:
            key, sep, value = override.partition("=")
            if not sep:
                raise ConfigError(f"-D {override!r}: expected KEY=VALUE")
            config[key.strip()] = value.strip()
        return _COMMANDS[args.command](args, config)
    except ConfigError as exc:
        print(redact(f"statebackend: configuration error: {exc}"), file=sys.stderr)
        return 2
    except StateBackendError as exc:
        print(redact(f"statebackend: {exc}"), file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one redacted line; a raw traceback could quote a credential
        print(redact(f"statebackend: unexpected {type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1


def _validate(args: argparse.Namespace, config: dict[str, str]) -> int:
    from statebackend.blobstores.base import open_blob_store
    from statebackend.checkpoint import CheckpointLog
    from statebackend.config import Settings
    from statebackend.contracts import BackendContext
    from statebackend.metrics import Metrics
    from statebackend.registry import resolve_factory

    settings = Settings.from_config(config)
    factories = {f for s in settings.stores.values() for f in (*s.backup_factories, s.restore_factory)}
    with open_blob_store(settings.blob_store_url, settings.blob_store_options) as blob_store:
        for factory_name in sorted(factories):
            checkpoint_log = CheckpointLog(blob_store, settings.job_name, "validate",
                                           read_versions=settings.checkpoint_read_versions,
                                           retained=settings.checkpoint_retained)
            context = BackendContext(
                factory_name=factory_name, job_name=settings.job_name, task_name="validate", stores={},
                blob_store=blob_store, checkpoint_log=checkpoint_log, executor=_NoExecutor(), metrics=Metrics(),
                options=settings.backend_options_for(factory_name),
            )
            resolve_factory(factory_name).factory.admin(context).validate_resources()
            print(redact(f"{factory_name}: OK ({blob_store.describe()})"))
    return 0


def _checkpoints(args: argparse.Namespace, config: dict[str, str]) -> int:
    from statebackend.blobstores.base import open_blob_store
    from statebackend.checkpoint import CheckpointLog, CheckpointV2
    from statebackend.config import Settings

    settings = Settings.from_config(config)
    with open_blob_store(settings.blob_store_url, settings.blob_store_options) as blob_store:
        log = CheckpointLog(blob_store, settings.job_name, args.task, read_versions=settings.checkpoint_read_versions)
        for entry in log.entries():
            cp = entry.checkpoint
            offsets = ",".join(f"{k}={v}" for k, v in sorted(cp.input_offsets.items()))
            if isinstance(cp, CheckpointV2):
                backends = ",".join(sorted(cp.state_checkpoint_markers))
                print(redact(f"#{entry.seq}\t{cp.checkpoint_id}\t{offsets}\t{backends}"))
            else:
                print(redact(f"#{entry.seq}\tv1\t{offsets}"))
    return 0


def _dump(args: argparse.Namespace, config: dict[str, str]) -> int:
    from statebackend.task import TaskStorage

    with tempfile.TemporaryDirectory(prefix="statebackend-dump-") as tmp:
        config = dict(config, **{"state.local.dir": tmp})
        with TaskStorage.open(config, args.task) as task:
            for key, value in task.store(args.store).items():
                print(f"{key!r}\t{value!r}")
    return 0


class _NoExecutor(Executor):
    """Admins never submit work; a validate run has no commit pool."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        raise StateBackendError("validate does not run commits")


_COMMANDS = {"validate": _validate, "checkpoints": _checkpoints, "dump": _dump}

if __name__ == "__main__":
    sys.exit(main())

"""The demo's word count (examples/wordcount.py, run by examples/demo.py) removes the temp dir it made, whether the
run succeeds or fails, unless asked to keep it; a directory the user gave is never removed. Spark is replaced by
stand-ins: what is checked is the directory's life, not the count (tests/test_examples.py runs the real demo)."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _wordcount(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run: Any) -> tuple[ModuleType, list[Path]]:
    """examples/wordcount.py with temp dirs made under ``tmp_path``, a stand-in Spark, and ``run`` as the job
    (called with the run's directory); returns the module and the run directories seen."""
    spec = importlib.util.spec_from_file_location("wordcount_example", ROOT / "examples" / "wordcount.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stopped: list[bool] = []

    class Spark:
        class sparkContext:  # the attribute Spark has
            @staticmethod
            def setLogLevel(level: str) -> None:
                pass

        @staticmethod
        def stop() -> None:
            stopped.append(True)

    seen: list[Path] = []

    def fake_run(spark: Any, args: Any, config: Any, run_dir: Path) -> int:
        assert run_dir.is_dir() and not stopped  # the directory lives while Spark runs
        seen.append(run_dir)
        return int(run(run_dir))

    monkeypatch.setattr(module, "local_spark_session", lambda *a, **k: Spark())
    monkeypatch.setattr(module, "_run", fake_run)
    return module, seen


def _temp_dirs(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("statebackend-wordcount-*"))


def test_the_temp_dir_is_removed_after_a_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module, seen = _wordcount(monkeypatch, tmp_path, lambda run_dir: (run_dir / "state").mkdir() or 0)
    assert module.main([]) == 0
    assert len(seen) == 1 and seen[0].parent.name.startswith("statebackend-wordcount-")
    assert _temp_dirs(tmp_path) == []


def test_the_temp_dir_is_removed_when_the_run_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fail(run_dir: Path) -> int:
        (run_dir / "partial").write_text("half a run")
        raise RuntimeError("the query failed")

    module, seen = _wordcount(monkeypatch, tmp_path, fail)
    with pytest.raises(RuntimeError, match="the query failed"):
        module.main([])
    assert seen and _temp_dirs(tmp_path) == []
    module, seen = _wordcount(monkeypatch, tmp_path, lambda run_dir: 1)  # FAIL: counts differ
    assert module.main([]) == 1 and seen and _temp_dirs(tmp_path) == []


def test_the_temp_dir_is_kept_when_asked_and_a_given_dir_always(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module, seen = _wordcount(monkeypatch, tmp_path, lambda run_dir: 0)
    assert module.main(["--keep-state"]) == 0
    kept = _temp_dirs(tmp_path)
    assert len(kept) == 1 and seen[0].parent == kept[0].resolve() and seen[0].is_dir()
    assert f"kept {kept[0]}" in capsys.readouterr().out
    given = tmp_path / "mine"
    module, seen = _wordcount(monkeypatch, tmp_path, lambda run_dir: 0)
    assert module.main(["--state-dir", str(given)]) == 0
    assert seen[0].parent == given.resolve() and seen[0].is_dir() and _temp_dirs(tmp_path) == kept

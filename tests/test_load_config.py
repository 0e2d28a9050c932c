"""statebackend.load_config: the one reader of a job's ``job.properties``, for Python code and the ``statebackend``
command alike; a file that cannot be read and a line that is not ``key=value`` are ConfigErrors naming the file and
the line."""

from __future__ import annotations

from pathlib import Path

import pytest

import statebackend
import statebackend.cli
import statebackend.config
from statebackend import ConfigError, Settings, TaskStorage, load_config
from statebackend.cli import main


def test_reads_key_value_lines_comments_and_blanks(tmp_path: Path) -> None:
    path = tmp_path / "job.properties"
    path.write_text(
        "# the job\n! also a comment\n\n  job.name = clicks  \nblob.store.url=file:///tmp/x?a=b\n"
        "stores.counts.backup.factories=changelog\njob.name=clicks2\nempty.value=\n",
        encoding="utf-8",
    )
    assert load_config(path) == {
        "job.name": "clicks2",
        "blob.store.url": "file:///tmp/x?a=b",
        "stores.counts.backup.factories": "changelog",
        "empty.value": "",
    }
    assert load_config(str(path)) == load_config(path)


def test_the_result_opens_a_task(tmp_path: Path) -> None:
    path = tmp_path / "job.properties"
    path.write_text(
        f"job.name=clicks\nstate.local.dir={tmp_path / 'state'}\nblob.store.url={(tmp_path / 'b').as_uri()}\n"
        "blob.store.create.if.missing=true\nstores.counts.backup.factories=changelog\n"
        "stores.counts.key.serde=string\nstores.counts.msg.serde=integer\n"
    )
    config = load_config(path)
    assert Settings.from_config(config).job_name == "clicks"
    with TaskStorage.open(config, "task-0") as storage:
        storage.store("counts").put("ada", 1)
        storage.commit_durably({"clicks": "1"})
    with TaskStorage.open(config, "task-0") as storage:
        assert storage.store("counts").get("ada") == 1


def test_a_missing_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "job.properties"
    with pytest.raises(ConfigError) as caught:
        load_config(missing)
    assert str(missing) in str(caught.value) and "cannot read config file" in str(caught.value)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)  # a directory


@pytest.mark.parametrize(("line", "problem"), [("job.name clicks", "no '='"), ("= clicks", "an empty key")])
def test_a_bad_line_names_the_file_and_the_line(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "job.properties"
    path.write_text(f"# comment\njob.name=clicks\n\n{line}\nstate.local.dir=/tmp\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:4: expected key=value") and problem in message and line.strip() in message


def test_a_bad_line_does_not_echo_a_secret(tmp_path: Path) -> None:
    path = tmp_path / "job.properties"
    path.write_text("blob.store.url az://user:hunter2secret@account/container\n")  # ':' or ' ' is no separator
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert f"{path}:1:" in str(caught.value) and "account/container" in str(caught.value)
    assert "hunter2secret" not in str(caught.value)


def test_a_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "job.properties"
    path.write_bytes(b"job.name=clicks\nstate.local.dir=/tmp/\xff\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value) and "line 2 is not UTF-8" in str(caught.value)


def test_one_reader_exported_from_the_package_the_config_and_used_by_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert statebackend.load_config is statebackend.config.load_config is load_config
    assert "load_config" in statebackend.__all__ and "load_config" in statebackend.config.__all__
    assert statebackend.cli.load_properties is load_config  # the command's earlier name: the same function
    path = tmp_path / "job.properties"
    path.write_text("job.name=clicks\nnot a line\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert main(["tasks", str(path)]) == 3
    assert capsys.readouterr().err.strip() == f"statebackend: configuration error: {caught.value}"
    read: list[str] = []

    def spy(where: str) -> dict[str, str]:
        read.append(where)
        return load_config(where)

    monkeypatch.setattr(statebackend.cli, "load_config", spy)
    assert main(["tasks", str(path)]) == 3 and read == [str(path)]

"""The ``nmt`` command itself: its version, plain help text, ``nmt run`` passing every option of the flow on, and
``nmt ui`` / ``nmt serve`` on this checkout's MLflow store."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from flows import pipeline as flow, sweep
from pipeline.cli import build_parser, flow_command, main
from tests.helpers.paths import REPO

#: A value for each option of ``python -m flows.pipeline`` that takes one; a new option needs one here.
SAMPLES = {"--profile": "tiny", "--repo": "elsewhere", "--timeout": "train=60", "--retry-delay": "download=1.5",
           "--kill-grace": "3"}


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert capsys.readouterr().out == f"nmt {pyproject['version']}\n"


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """No reST markup (``x``, :func:`x`) nor Markdown backticks in what any --help of nmt prints."""
    for argv in [], ["run"], ["sweep"], ["translate"], ["export"], ["profile"], ["ui"], ["serve"]:
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert "usage: nmt" in out and "`" not in out, out


@pytest.mark.parametrize("flow_main", [flow.main, sweep.main], ids=["flows.pipeline", "flows.sweep"])
def test_the_flows_help_is_plain_text(flow_main, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        flow_main(["--help"])
    out = capsys.readouterr().out
    assert "usage: python -m flows." in out and "`" not in out, out


def _profile_helps(parser: argparse.ArgumentParser) -> list[str]:
    """The help of every ``--profile`` option of ``parser`` and its sub-commands."""
    found = []
    for action in parser._actions:  # noqa: SLF001 - argparse lists a parser's options nowhere public
        if "--profile" in action.option_strings:
            found.append(action.help)
        for sub in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            found += _profile_helps(sub)
    return found


def test_every_profile_help_names_every_profile_of_the_folder() -> None:
    names = sorted(p.stem for p in (REPO / "profiles").glob("*.yaml"))
    assert "paper-big" in names
    helps = [*_profile_helps(build_parser()), *_profile_helps(flow.build_parser())]
    assert len(helps) == 3, helps  # nmt run, nmt serve, python -m flows.pipeline
    for text in helps:
        assert ", ".join(names) in text, text


def test_nmt_run_takes_every_option_of_the_flow_and_passes_it_on() -> None:
    parser = flow.build_parser()
    argv: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse lists a parser's options nowhere public
        flag = action.option_strings[0] if action.option_strings else None
        if flag not in (None, "-h", "--stages"):  # nmt run takes the stages as positionals
            argv += [flag] if action.nargs == 0 else [flag, SAMPLES[flag]]
    nmt = build_parser().parse_args(["run", "train", "average", *argv])
    passed = flow_command(nmt)
    assert passed[0] == "flows.pipeline"
    assert vars(parser.parse_args(passed[1:])) == vars(parser.parse_args(["--stages", "train", "average", *argv]))
    assert flow_command(build_parser().parse_args(["run"])) == ["flows.pipeline"]  # defaults stay the flow's


@pytest.mark.parametrize(("argv", "message"), [
    (["--timeout", "train"], "argument --timeout: train: expected STAGE=SECONDS, e.g. train=86400"),
    (["--retry-delay", "download=soon"], "argument --retry-delay: soon: must be seconds, a finite number >= 0"),
    (["--kill-grace", "-1"], "argument --kill-grace: -1: must be seconds, a finite number >= 0"),
])
def test_a_bad_run_option_is_one_usage_line(argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", *argv])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"nmt run: error: {message}; see nmt run --help"]


def _nmt(*args: str, cwd: Path, **kw) -> subprocess.Popen:  # noqa: ANN003
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the checkout's own store
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, env=env, text=True, **kw)


@pytest.mark.parametrize("verb", ["ui", "serve"])
def test_a_port_out_of_range_is_one_usage_line_naming_it(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--port", "70000"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"nmt {verb}: error: argument --port: 70000: must be a port from 1 to 65535; "
                                       f"see nmt {verb} --help\n")


def test_serve_without_a_registered_model_is_one_line_naming_it(tmp_path: Path) -> None:
    proc = _nmt("serve", "--profile", "tiny", cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert err.splitlines()[-1].startswith("error: nmt serve: no version of registered model 'tiny-transformer' "
                                           "holds alias 'candidate' in sqlite:///"), err
    assert not (tmp_path / "mlflow.db").exists() and (tmp_path / ".mlflow" / "mlflow.db").is_file()  # no stray


@pytest.mark.slow
def test_ui_serves_this_checkouts_store_on_loopback(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _nmt("ui", "--port", str(port), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
    try:
        deadline, status = time.monotonic() + 120, None
        while status is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status  # noqa: S310
            except OSError:
                time.sleep(1)
        assert status == 200, f"nmt ui did not answer (exit {proc.poll()})"
        assert (tmp_path / ".mlflow" / "mlflow.db").is_file() and not (tmp_path / "mlruns").exists()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def _documented_nmt_commands() -> list[tuple[str, str]]:
    """(file, command) for every `nmt ...` the README and docs/ show: inline code spans and code-block lines."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        spans = re.findall(r"`(nmt [^`]+)`", text)
        lines = [m.group(1) for m in re.finditer(r"^\s*(?:[|] )?(?:echo .*\| )?(nmt .+?)(?:\s+#.*)?$", text, re.M)]
        found += [(path.name, command) for command in spans + lines]
    return found


def test_every_documented_nmt_command_names_a_verb_and_options_that_exist() -> None:
    """What the README and docs/ show as `nmt VERB --option` parses: the verb exists and takes each option."""
    verbs = next(a for a in build_parser()._actions if a.dest == "command").choices
    commands = _documented_nmt_commands()
    assert len(commands) > 20
    for where, command in commands:
        words = command.replace("\\|", "|").split()
        verb = words[1]
        if verb.startswith("--") or verb == "COMMAND":  # nmt --version, nmt --help, nmt COMMAND --help
            assert verb in {"--version", "--help", "COMMAND"}, (where, command)
            continue
        assert verb in verbs, (where, command)
        known = {option for action in verbs[verb]._actions for option in action.option_strings}
        for word in words[2:]:
            option = word.strip("[]…").split("=")[0]
            if option.startswith("--"):
                assert option in known, f"{where}: `{command}`: nmt {verb} has no {option}"


@pytest.mark.parametrize("where", ["outside", "root"])
def test_nmt_run_refuses_an_absolute_paths_value_before_dvc_or_any_server(tmp_path: Path, where: str) -> None:
    """A `paths.clean` that is an existing folder outside the checkout makes DVC fail the clean stage before its
    command runs, with no reason (`ERROR: failed to reproduce 'clean': `, an AssertionError in dvc/output.py); the
    flow checks the params first, so `nmt run` is the stage's own one line, before any Prefect server or DVC."""
    import shutil

    import yaml

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REPO / "dvc.yaml", repo / "dvc.yaml")
    shutil.copytree(REPO / "profiles", repo / "profiles")
    outside = tmp_path / "elsewhere" if where == "outside" else Path("/")
    outside.mkdir(exist_ok=True)
    from pipeline.project.profiles import merged_profile

    merged = merged_profile("tiny", REPO)
    merged["paths"]["clean"] = str(outside)
    (repo / "params.yaml").write_text(yaml.safe_dump(merged, sort_keys=False), encoding="utf-8")
    before = (repo / "params.yaml").read_bytes()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run([sys.executable, "-m", "flows.pipeline", "--stages", "clean", "--repo", str(repo)],
                          cwd=repo, env={**env, "NMT_TRACKING": "off", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr.splitlines()) == (1, [
        f"error: {repo / 'params.yaml'}: paths.clean: {outside} lies outside {repo}, the folder of the params file; "
        "use a relative path inside data/, runs/, metrics/, plots/ or reports/"])
    assert (repo / "params.yaml").read_bytes() == before and not (repo / ".dvc").exists()
    assert sorted(p.name for p in repo.iterdir()) == ["dvc.yaml", "params.yaml", "profiles"]


def test_mlflows_own_commands_find_the_projects_store_with_the_tracked_env_file(tmp_path: Path) -> None:
    """MLflow reads its store from MLFLOW_TRACKING_URI only; `mlflow --env-file mlflow.env` sets it from the
    checkout, and the stray ./mlflow.db a bare command would write is git-ignored."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"NMT_TRACKING": "on"}
    made = subprocess.run([sys.executable, "-c", "from pipeline.tracking import runs as tracking\n"
                           f"with tracking.stage_run('audit', root={str(tmp_path)!r}) as run:\n    run.open()"],
                          env=env | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True, check=False)
    assert made.returncode == 0, made.stderr
    shutil.copy(REPO / "mlflow.env", tmp_path / "mlflow.env")
    found = subprocess.run([str(Path(sys.executable).with_name("mlflow")), "--env-file", "mlflow.env", "experiments",
                            "search"], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert found.returncode == 0 and "wmt14-transformer" in found.stdout, found.stdout + found.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mlflow", "mlflow.env"]  # no ./mlflow.db, no mlruns/
    ignored = subprocess.run(["git", "check-ignore", "-q", "mlflow.db"], cwd=REPO, check=False)
    assert ignored.returncode == 0

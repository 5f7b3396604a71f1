"""The ``nmt`` command itself: its version, plain help text, and ``nmt run`` passing every option of the flow on."""

from __future__ import annotations

import tomllib

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
    for argv in [], ["run"], ["sweep"], ["translate"], ["export"], ["profile"]:
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

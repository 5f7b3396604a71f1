"""The ``NMT_*`` environment table: complete, documented, validated at once, read by every call site."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import env
from pipeline.core.env import Fault, Settings, settings
from pipeline.core.errors import ConfigError
from tests.helpers.paths import REPO

NAME = re.compile(r"NMT_[A-Z][A-Z0-9_]*")
MENTION = re.compile(r"NMT_[A-Z][A-Z0-9_]*\*?")  # NMT_FAULT_* is a wildcard, not a variable


def _source_names(exclude: Path | None = None) -> dict[str, set[str]]:
    """Every ``NMT_*`` name in a string literal (docstrings and f-string parts included) of pipeline/ and flows/,
    and every attribute name read there (under ``"."``: ``settings().threads`` reads ``.threads``)."""
    found: dict[str, set[str]] = {}
    for package in ("pipeline", "flows"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == exclude:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    for name in MENTION.findall(node.value):
                        if not name.endswith("*"):
                            found.setdefault(name, set()).add(str(path.relative_to(REPO)))
                elif isinstance(node, ast.Attribute):
                    found.setdefault("." + node.attr, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_variable_in_the_source_is_in_the_table() -> None:
    retired_only_in_env = {"pipeline/core/env.py"}
    missing = {name: where for name, where in _source_names().items() if name.startswith("NMT_")
               and name not in env.NAMES and not (name in env.RETIRED and where == retired_only_in_env)}
    assert not missing, f"NMT_* variables read or named in the code but absent from pipeline/core/env.py: {missing}"


def test_the_table_holds_at_most_24_variables_and_no_retired_one() -> None:
    assert len(env.NAMES) <= 24, env.NAMES
    assert not set(env.RETIRED) & set(env.NAMES)


@pytest.mark.parametrize("name", sorted(env.RETIRED))
def test_a_retired_variable_is_one_line_naming_its_replacement(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        settings({name: " 2 ", "NMT_NPROC": "1"})
    assert err.value.problems == [f"{name}='2': no longer read; {env.RETIRED[name]}"]
    assert settings({name: " "}) == Settings()  # blank = unset, as for every variable


def test_every_variable_in_the_table_is_used_somewhere_else() -> None:
    used = _source_names(exclude=REPO / "pipeline" / "core" / "env.py")
    stale = [f.validation_alias for name, f in Settings.model_fields.items()
             if f.validation_alias not in used and "." + name not in used]
    assert not stale, f"in pipeline/core/env.py but neither named nor read anywhere else: {stale}"


def test_every_variable_is_typed_and_documented_once() -> None:
    assert len(env.NAMES) == len(set(env.NAMES)) >= 23
    for name, f in Settings.model_fields.items():
        assert NAME.fullmatch(str(f.validation_alias)), name
        assert f.description and "\n" not in f.description and len(f.description) < 140, name
        assert f.annotation is not None, name


def test_every_variable_has_a_row_in_the_configuration_guide() -> None:
    """docs/configuration.md holds the table users read: a row per variable, none for a variable no longer read."""
    rows = re.findall(r"^\| `(NMT_[A-Z0-9_]+)` \|", (REPO / "docs" / "configuration.md").read_text(encoding="utf-8"),
                      re.MULTILINE)
    assert sorted(rows) == sorted(env.NAMES)


def test_the_configuration_guide_says_what_each_field_describes() -> None:
    """Each row's meaning is its field's description, word for word: one home for a variable's one line."""
    rows = dict(re.findall(r"^\| `(NMT_[A-Z0-9_]+)` \|.*\| ([^|]+) \|$",
                           (REPO / "docs" / "configuration.md").read_text(encoding="utf-8"), re.MULTILINE))
    assert rows == {str(f.validation_alias): f.description for f in Settings.model_fields.values()}


def test_defaults_when_unset_or_blank() -> None:
    s = settings({})
    assert s == Settings()
    assert (s.nproc, s.nnodes, s.node_rank) == (None, 1, None)
    assert (s.rdzv_endpoint, s.rdzv_id, s.max_restarts, s.device, s.threads) == (None, "nmt-train", None, None, None)
    assert (s.dist_timeout_s, s.fault) == (1800.0, None)
    assert (s.data_mirror, s.download_cache, s.download_backoff_s) == (None, REPO / ".cache" / "downloads", 1.0)
    assert (s.data_workers, s.tracking, s.log_level, s.model_name) == (None, True, "INFO", None)
    assert s.prefect_flow_run_id is None
    assert settings({name: "  " for name in env.NAMES}) == Settings()  # blank = unset
    assert settings({"PATH": "/bin", "NMT_UNKNOWN": "x"}) == Settings()  # other variables are not ours


def test_good_values_are_parsed_to_their_types(tmp_path: Path) -> None:
    s = settings({
        "NMT_NPROC": "4", "NMT_NNODES": " 2 ", "NMT_NODE_RANK": "0",
        "NMT_RDZV_ENDPOINT": "node0:29400", "NMT_RDZV_ID": "job", "NMT_MAX_RESTARTS": "0",
        "NMT_DEVICE": "cpu", "NMT_THREADS": "1", "NMT_DIST_TIMEOUT_S": "8",
        "NMT_FAULT_POINT": f"collective:3:stall:1@{tmp_path / 'a:b@c'}",
        "NMT_DATA_MIRROR": f"file://{tmp_path}", "NMT_DOWNLOAD_CACHE": str(tmp_path / "cache"),
        "NMT_DOWNLOAD_BACKOFF_S": "0", "NMT_DATA_WORKERS": "2", "NMT_TRACKING": "off", "NMT_LOG_LEVEL": "debug",
        "NMT_MODEL_NAME": " tiny ", "NMT_PREFECT_FLOW_RUN_ID": "abc"})
    assert (s.nproc, s.nnodes, s.node_rank) == (4, 2, 0)
    assert (s.rdzv_endpoint, s.rdzv_id, s.max_restarts, s.device, s.threads) == ("node0:29400", "job", 0, "cpu", 1)
    assert s.dist_timeout_s == 8.0
    assert s.fault == Fault("collective", 3, "stall", 1, once=tmp_path / "a:b@c")  # the file may hold ':' and '@'
    assert (s.data_mirror, s.download_cache, s.download_backoff_s) == (str(tmp_path), tmp_path / "cache", 0.0)
    assert (s.data_workers, s.tracking, s.log_level, s.model_name) == (2, False, "DEBUG", "tiny")
    assert s.prefect_flow_run_id == "abc"


def test_each_profile_registers_its_own_model_unless_nmt_model_name_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NMT_MODEL_NAME", raising=False)
    assert [env.model_name(p) for p in ("paper", "demo", "tiny")] == [
        "wmt14-transformer", "demo-transformer", "tiny-transformer"]
    monkeypatch.setenv("NMT_MODEL_NAME", "mine")
    assert env.model_name("tiny") == "mine"


@pytest.mark.parametrize("value", ["off", "0", "false", "no", "OFF", " No "])
def test_tracking_off_spellings(value: str) -> None:
    assert settings({"NMT_TRACKING": value}).tracking is False


@pytest.mark.parametrize("value", ["on", "1", "true", "yes", " YES "])
def test_tracking_on_spellings(value: str) -> None:
    assert settings({"NMT_TRACKING": value}).tracking is True


SWITCH_PROBLEM = "expected on/off: one of on, 1, true, yes or off, 0, false, no"
NAME_RULE = "MLflow refuses a registered model name with '/' or ':' or starting with '..'; choose another name"


@pytest.mark.parametrize("name, value, problem", [
    ("NMT_TRACKING", "abc", SWITCH_PROBLEM),
    ("NMT_COMPILE", "1.5", SWITCH_PROBLEM),
    ("NMT_DETERMINISTIC", "enabled", SWITCH_PROBLEM),
    ("NMT_RDZV_TIMEOUT_S", "100000000000000000000", "Input should be less than or equal to 604800"),
    ("NMT_RDZV_TIMEOUT_S", "9" * 5000, "expected a whole number of at most 30 digits"),
    ("NMT_DIST_TIMEOUT_S", "1e300", "Input should be less than or equal to 604800"),
    ("NMT_MODEL_NAME", "a/b", NAME_RULE),
    ("NMT_MODEL_NAME", "..", NAME_RULE),
    ("NMT_MODEL_NAME", "tiny\nsecond", "holds a control character (a newline, a tab...); choose a name of printable "
                                       "characters"),
    ("NMT_MODEL_NAME", "m" * 600, "600 characters, more than 256; choose a shorter name"),
])
def test_a_stage_refuses_a_bad_switch_bound_or_model_name_in_one_line(name: str, value: str, problem: str,
                                                                       tmp_path: Path) -> None:
    """Through the real command: any text used to mean on, 1e300 s overflowed torch's timeout, 10^20 s a
    threading.Timer, and MLflow raised its own traceback at register for a/b (or kept a newline in the name)."""
    run = subprocess.run([sys.executable, "-m", "pipeline.download", "--params", "absent.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("NMT_")}, name: value})
    quoted = value if len(value) <= 80 else value[:77] + "..."
    assert (run.returncode, run.stderr) == (1, f"error: stage download: environment: {name}={quoted!r}: {problem}\n")
    assert not list(tmp_path.iterdir())


def test_bounds_and_names_at_their_edges() -> None:
    assert settings({"NMT_RDZV_TIMEOUT_S": "604800", "NMT_DIST_TIMEOUT_S": "604800.0"}).rdzv_timeout_s == 604800
    assert settings({"NMT_MODEL_NAME": "n" * 256}).model_name == "n" * 256
    assert settings({"NMT_MODEL_NAME": "my model.v2-é"}).model_name == "my model.v2-é"


def test_bad_values_give_one_error_naming_each_variable() -> None:
    bad = {"NMT_NPROC": "zero", "NMT_NNODES": "0", "NMT_NODE_RANK": "-1",
           "NMT_MAX_RESTARTS": "-1", "NMT_DEVICE": "gpu", "NMT_THREADS": "1.5", "NMT_DIST_TIMEOUT_S": "0",
           "NMT_FAULT_POINT": "mid_sav:x",
           "NMT_DOWNLOAD_BACKOFF_S": "-1", "NMT_DATA_WORKERS": "many", "NMT_TRACKING": "off"}
    with pytest.raises(ConfigError) as err:
        settings(bad)
    problems = err.value.problems
    assert err.value.source == "environment"
    assert problems == [
        "NMT_NPROC='zero': expected a whole number of at most 30 digits",
        "NMT_NNODES='0': Input should be greater than or equal to 1",
        "NMT_NODE_RANK='-1': Input should be greater than or equal to 0",
        "NMT_MAX_RESTARTS='-1': Input should be greater than or equal to 0",
        "NMT_DEVICE='gpu': Input should be 'cpu' or 'cuda'",
        "NMT_THREADS='1.5': expected a whole number of at most 30 digits",
        "NMT_DIST_TIMEOUT_S='0': Input should be greater than 0",
        ("NMT_FAULT_POINT='mid_sav:x': unknown point 'mid_sav'; one of preflight, forward, mid_accum, collective, "
         "before_save, mid_save, after_save, after_step; step 'x' is not a non-negative integer"),
        "NMT_DOWNLOAD_BACKOFF_S='-1': Input should be greater than or equal to 0",
        "NMT_DATA_WORKERS='many': expected a whole number of at most 30 digits",
    ]
    assert str(err.value).startswith("environment: 10 problem(s) in the configuration:\n  - NMT_NPROC='zero'")


@pytest.mark.parametrize("name, value", [("NMT_DIST_TIMEOUT_S", "nan"), ("NMT_DIST_TIMEOUT_S", "inf"),
                                         ("NMT_DOWNLOAD_BACKOFF_S", "soon"), ("NMT_NPROC", "2_0"),
                                         ("NMT_FAULT_POINT", "forward"), ("NMT_FAULT_POINT", "forward:1:kill:0:x"),
                                         ("NMT_FAULT_POINT", "forward:1@"), ("NMT_FAULT_POINT", "forward@x:1")])
def test_more_bad_values(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^environment: {name}='{re.escape(value)}': [^\n]+$"):
        settings({name: value})


def test_fault_specs_name_the_variable() -> None:
    def fault(spec: str) -> Fault | None:
        return settings({"NMT_FAULT_POINT": spec}).fault

    assert fault("forward:3") == Fault("forward", 3)
    assert fault("forward:3:exit@/tmp/x") == Fault("forward", 3, "exit", once=Path("/tmp/x"))
    with pytest.raises(ConfigError, match=r"NMT_FAULT_POINT='forward:3@': no file after '@'$"):
        fault("forward:3@")
    with pytest.raises(ConfigError, match=r"NMT_FAULT_POINT='forward:1:explode': unknown action 'explode'"):
        fault("forward:1:explode")
    with pytest.raises(ConfigError, match=r"NMT_FAULT_POINT='forward': expected <point>:<step>"):
        fault("forward")


def test_read_once_per_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMT_NPROC", "3")
    first = settings()
    assert settings() is first and first.nproc == 3  # cached
    monkeypatch.setenv("NMT_NPROC", "5")
    assert settings().nproc == 5  # a changed variable is seen
    settings.cache_clear()
    assert settings().nproc == 5 and settings({"NMT_NPROC": "7"}).nproc == 7


def test_env_module_imports_no_torch_or_mlflow() -> None:
    tree = ast.parse((REPO / "pipeline" / "core" / "env.py").read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"torch", "mlflow", "prefect", "yaml"}
    code = "import sys, pipeline.core.env as e; e.settings(); print(sorted({'torch', 'mlflow'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# The call sites read the table: bad values are reported as ConfigError naming the variable.


def test_launch_reads_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.training import torchrun

    for name in env.NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NMT_NPROC", "2")
    monkeypatch.setenv("NMT_DEVICE", "cpu")
    assert "--nproc_per_node=2" in torchrun.torchrun_command([])
    assert not any(a.startswith("--max-restarts") for a in torchrun.torchrun_command([]))  # cpu: 0 restarts
    monkeypatch.setenv("NMT_NNODES", "2")
    with pytest.raises(ConfigError, match=r"NMT_NNODES=2 needs NMT_RDZV_ENDPOINT \(host:port where the nodes meet"):
        torchrun.torchrun_command([])
    monkeypatch.setenv("NMT_RDZV_ENDPOINT", "node0:29400")
    monkeypatch.setenv("NMT_RDZV_ID", "job7")
    assert "--rdzv_id=job7" in torchrun.torchrun_command([])  # no NMT_NODE_RANK: a c10d rendezvous
    monkeypatch.setenv("NMT_NODE_RANK", "2")
    with pytest.raises(ConfigError, match=r"NMT_NODE_RANK=2 must be < NMT_NNODES=2"):
        torchrun.torchrun_command([])
    monkeypatch.setenv("NMT_NODE_RANK", "1")  # a static rendezvous at node 0's address and port
    monkeypatch.setenv("NMT_RDZV_ENDPOINT", "10.0.0.1:29501")
    assert torchrun.torchrun_command([])[4:9] == ["--nnodes=2", "--nproc_per_node=2", "--node_rank=1",
                                                "--master_addr=10.0.0.1", "--master_port=29501"]
    monkeypatch.setenv("NMT_RDZV_ENDPOINT", "[fd00::1]")
    assert torchrun.torchrun_command([])[7:9] == ["--master_addr=fd00::1", "--master_port=29500"]
    monkeypatch.setenv("NMT_RDZV_ENDPOINT", "10.0.0.1:http")
    with pytest.raises(ConfigError, match=r"NMT_RDZV_ENDPOINT='10.0.0.1:http': expected host:port of the rendezvous"):
        torchrun.torchrun_command([])


def test_stage_modules_read_the_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pipeline import tracking
    from pipeline.data import workers
    from pipeline.training import faults

    monkeypatch.setenv("NMT_DATA_WORKERS", "3")
    assert workers.data_workers() == 3
    monkeypatch.setenv("NMT_TRACKING", "No")
    assert tracking.enabled() is False
    monkeypatch.setenv("NMT_FAULT_POINT", f"after_step:5:exit@{tmp_path / 'once'}")
    (tmp_path / "once").touch()  # already fired: hit() returns
    faults.hit("after_step", 5)
    assert faults.active() == Fault("after_step", 5, "exit", once=tmp_path / "once")
    monkeypatch.setenv("NMT_DATA_WORKERS", "0")
    with pytest.raises(ConfigError, match=r"NMT_DATA_WORKERS='0': Input should be greater than or equal to 1"):
        workers.data_workers()
    with pytest.raises(ConfigError, match=r"NMT_DATA_WORKERS='0'"):  # every read checks the whole table
        tracking.enabled()


def test_download_reads_the_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pipeline.core.config import DownloadConfig
    from pipeline.data.locate import FetchEnv

    cfg = DownloadConfig(dataset="multi30k", retries=1, timeout_s=5.0)
    monkeypatch.setenv("NMT_DATA_MIRROR", f"file://{tmp_path}")
    monkeypatch.setenv("NMT_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NMT_DOWNLOAD_BACKOFF_S", "0.5")
    fetch_env = FetchEnv.from_env(cfg)
    assert (fetch_env.mirror, fetch_env.cache_dir, fetch_env.policy.backoff_s) == (str(tmp_path), tmp_path / "cache",
                                                                                    0.5)
    monkeypatch.setenv("NMT_DOWNLOAD_BACKOFF_S", "fast")
    with pytest.raises(ConfigError, match=r"NMT_DOWNLOAD_BACKOFF_S='fast': Input should be a valid number"):
        FetchEnv.from_env(cfg)


def test_distributed_timeout_reads_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.training import distributed

    monkeypatch.setenv("NMT_DIST_TIMEOUT_S", "8")
    assert distributed.timeout_s() == 8.0
    monkeypatch.setenv("NMT_DIST_TIMEOUT_S", "-3")
    with pytest.raises(ConfigError, match=r"NMT_DIST_TIMEOUT_S='-3': Input should be greater than 0"):
        distributed.timeout_s()


def test_a_stage_reports_a_bad_environment_as_one_error(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.core.console import run_cli, setup_logging

    monkeypatch.setenv("NMT_NPROC", "zero")
    monkeypatch.setenv("NMT_THREADS", "-2")
    setup_logging()  # logging still comes up (INFO) with a bad environment
    called = []
    assert run_cli("demo", lambda params, args: called.append(params), ["--params", "absent.yaml"]) == 1
    assert not called
    assert capsys.readouterr().err == (
        "error: stage demo: environment: 2 problem(s) in the configuration:\n"
        "  - NMT_NPROC='zero': expected a whole number of at most 30 digits\n"
        "  - NMT_THREADS='-2': Input should be greater than or equal to 1\n")


def test_child_commands_run_in_this_interpreters_environment() -> None:
    """``.venv/bin/nmt run`` without an activated venv: dvc and DVC's ``python -m pipeline.<stage>`` are this venv's."""
    script = ("from pipeline.core import env; env.prefer_this_interpreter(); import shutil; "
              "print(shutil.which('python')); print(shutil.which('dvc'))")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60, check=True)
    folder = Path(sys.executable).parent
    assert done.stdout.splitlines() == [str(folder / "python"), str(folder / "dvc")]

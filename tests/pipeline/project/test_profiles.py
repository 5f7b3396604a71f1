"""Switching profiles never loses a hand-edited params.yaml."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.config import load_params, params_from_dict
from pipeline.core.env import model_name
from pipeline.core.errors import ConfigError
from pipeline.core.paths import SHARED_DATA
from pipeline.project.profiles import active_profile, listing, merged_profile, write_profile
from tests.helpers.lockholder import hold_lock
from tests.helpers.paths import REPO
from tests.helpers.repoutil import init_git_dvc


PROFILES = sorted(path.stem for path in (REPO / "profiles").glob("*.yaml"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    write_profile("paper", tmp_path)
    return tmp_path


def test_a_generated_params_yaml_is_replaced_without_a_backup(root: Path) -> None:
    write_profile("tiny", root)
    write_profile("demo", root)
    write_profile("paper", root)
    assert not list(root.glob("params.yaml.*"))


def test_a_hand_edited_params_yaml_is_kept_as_a_backup(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    params = root / "params.yaml"
    edited = params.read_text(encoding="utf-8").replace("warmup_steps: 4000", "warmup_steps: 8000")
    params.write_text(edited, encoding="utf-8")
    write_profile("demo", root)
    (backup,) = root.glob("params.yaml.*.bak")
    assert backup.read_text(encoding="utf-8") == edited
    assert "profile: demo" in params.read_text(encoding="utf-8")
    assert f"params.yaml had edits that no profile produces; kept them in {backup}" in caplog.text


def test_the_profiles_folder_holds_the_documented_profiles() -> None:
    assert PROFILES == ["demo", "multi30k", "paper", "paper-big", "tiny"]


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_is_decided_by_steps_and_averages_the_end_of_training(name: str) -> None:
    """The rule params.yaml states: last_n x save_every_steps <= 20% of max_steps; no wall clock decides."""
    params = params_from_dict(merged_profile(name, REPO))
    train, average = params.train, params.average
    assert average.last_n * train.save_every_steps <= 0.2 * train.max_steps, name
    assert train.keep_last >= average.last_n and train.max_minutes == 0, name


def _nmt_profile(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "profile"], cwd=root, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_listing_shows_each_profile_with_its_description_and_marks_the_active_one(root: Path) -> None:
    (root / "profiles" / "bare.yaml").write_text("profile: bare\n", encoding="utf-8")  # no comment: no description
    write_profile("demo", root)
    proc = _nmt_profile(root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "  bare",
        "* demo       Multi30k on a laptop CPU in minutes (~2.4M parameters, 8k vocabulary).",
        "  multi30k   Multi30k on one GPU in minutes (7.6M parameters, 8k vocabulary): 38 epochs in under 3 minutes "
        "on an H100.",
        "  paper      THE configuration (profile `paper`: the base Transformer of Vaswani et al. 2017 on WMT14 "
        "EN->DE).",
        "  paper-big  Transformer (big) of Vaswani et al. 2017 on WMT14 EN->DE: the paper's 28.4 BLEU model (Table 2, "
        "Table 3 \"big\").",
        "  tiny       A few hundred pairs and a toy model, for tests and smoke runs (minutes on CPU: it decodes to the "
        "length cap).",
    ]


@pytest.mark.parametrize("params", [None, "profile: [unclosed\n", "just text\n", "profile: nosuch\n",
                                    "profile: &p tiny\nother: *p\n"])
def test_listing_marks_nothing_without_a_params_yaml_that_names_a_profile(root: Path, params: str | None) -> None:
    target = root / "params.yaml"
    if params is None:
        target.unlink()
    else:
        target.write_text(params, encoding="utf-8")
    assert active_profile(root) == (None if params is None or "nosuch" not in params else "nosuch")
    assert [line.split()[0] for line in listing(root)] == PROFILES


def _nmt(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=root, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_switch_is_refused_while_a_run_holds_the_workspace(root: Path) -> None:
    """The profile switch takes the run's lock: params.yaml stays what the running pipeline reads."""
    holder = hold_lock(root, "flow run f00")
    try:
        params = (root / "params.yaml").read_bytes()
        proc = _nmt(root, "profile", "demo")
        assert proc.returncode == 1
        assert proc.stderr.splitlines() == [
            "error: .dvc/tmp/nmt-pipeline.lock: another pipeline run holds this workspace "
            f"(pid {holder.pid}, since {proc.stderr.split('since ')[1].split(',')[0]}, flow run f00); wait for it "
            "to end or stop it, then run `nmt profile demo` again"]
        assert (root / "params.yaml").read_bytes() == params and not list(root.glob("params.yaml.*"))
    finally:
        holder.communicate("", timeout=30)
    assert _nmt(root, "profile", "demo").returncode == 0  # the run ended: the lock is free
    assert active_profile(root) == "demo"


def test_a_profile_with_yaml_anchors_is_refused_naming_its_line(root: Path) -> None:
    (root / "profiles" / "anchored.yaml").write_text("# anchors\ntrain:\n  warmup_steps: &w 100\n  log_every_steps: *w\n",
                                                     encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        merged_profile("anchored", root)
    assert str(info.value) == (f"{root / 'profiles' / 'anchored.yaml'}: line 3, column 17: YAML anchors and aliases "
                               "are not accepted (found &w); write the value out in full")
    assert not list(root.glob("params.yaml.*"))


def test_paper_big_is_the_papers_big_model_on_the_paper_profiles_data(root: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Table 3 "big" for EN-DE (P_drop 0.3, 300k steps) averaging the last 20 checkpoints written 10 minutes (600 steps
    at 1.0 s/step) apart (§6.1); its own runs beside paper's, the same WMT14 data folders."""
    write_profile("paper-big", root)
    params = load_params(root / "params.yaml")  # validates, layout included
    paper = params_from_dict(merged_profile("paper", root))
    model, train = params.model, params.train
    assert params.profile == "paper-big"
    assert (model.d_model, model.n_heads, model.d_ff, model.n_layers) == (1024, 16, 4096, 6)
    assert (model.dropout, train.label_smoothing, train.max_steps, train.warmup_steps) == (0.3, 0.1, 300_000, 4000)
    assert (train.tokens_per_step, train.save_every_steps, train.keep_last) == (25000, 600, 20)
    assert params.average.last_n == 20
    assert [getattr(params.paths, k) for k in SHARED_DATA] == [getattr(paper.paths, k) for k in SHARED_DATA]
    assert params.paths.train == "runs/paper-big/train" and params.paths.reports == "reports/paper-big"
    monkeypatch.delenv("NMT_MODEL_NAME", raising=False)
    assert model_name(params.profile) == "paper-big-transformer"  # the registered model


KNOWN = "known: demo, multi30k, paper, paper-big, tiny"


@pytest.fixture
def beside_victim(tmp_path: Path) -> tuple[Path, Path]:
    """A checkout at ``tmp_path/checkout`` and, two levels above its profiles/, a valid ``victim.yaml`` beside a
    folder ``victim/`` holding another project's dvc.lock."""
    root = tmp_path / "checkout"
    shutil.copytree(REPO / "profiles", root / "profiles")
    write_profile("paper", root)
    shutil.copy(REPO / "profiles" / "tiny.yaml", tmp_path / "victim.yaml")
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n", encoding="utf-8")
    return root, tmp_path


@pytest.mark.parametrize("name", ["../../victim", "../profiles/tiny", "/etc/passwd", "tiny/../tiny"])
def test_a_profile_name_that_leaves_profiles_is_refused_with_one_line(beside_victim: tuple[Path, Path],
                                                                    name: str) -> None:
    """`nmt profile NAME` reads only profiles/NAME.yaml of a name profiles/ lists: nothing outside is read or
    written, params.yaml stays as it was."""
    root, outside = beside_victim
    params, lock = (root / "params.yaml").read_bytes(), (outside / "victim" / "dvc.lock").read_bytes()
    proc = _nmt(root, "profile", name)
    assert (proc.returncode, proc.stderr.splitlines()) == (1, [
        f"error: profiles: no such profile {name!r} (a file name of profiles/*.yaml without .yaml); {KNOWN}"])
    assert (root / "params.yaml").read_bytes() == params and not list(root.glob("params.yaml.*"))
    assert (outside / "victim" / "dvc.lock").read_bytes() == lock


def test_nmt_run_refuses_a_profile_name_outside_profiles_before_it_starts(beside_victim: tuple[Path, Path]) -> None:
    root, _ = beside_victim
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    params = (root / "params.yaml").read_bytes()
    proc = _nmt(root, "run", "--profile", "../../victim")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"error: --profile: no such profile '../../victim' (a file name of profiles/*.yaml without .yaml); {KNOWN}")
    assert (root / "params.yaml").read_bytes() == params and not (root / "mlruns").exists()


def test_the_switch_is_refused_while_a_plain_dvc_repro_runs(tmp_path: Path) -> None:
    """A `dvc repro` started outside `nmt run` holds DVC's lock (.dvc/tmp/lock); the switch takes the same lock, so
    params.yaml and dvc.lock stay what that repro read and writes."""
    root = init_git_dvc(tmp_path / "repo")
    shutil.copytree(REPO / "profiles", root / "profiles")
    write_profile("paper", root)
    (root / "wait.py").write_text("import pathlib, time\npathlib.Path('started').touch()\ntime.sleep(120)\n",
                                  encoding="utf-8")
    (root / "dvc.yaml").write_text("stages:\n  slow:\n    cmd: python wait.py\n    deps: [wait.py]\n"
                                   "    params: [profile]\n", encoding="utf-8")
    (root / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n", encoding="utf-8")
    names = ["params.yaml", "dvc.lock"]
    before = {name: (root / name).read_bytes() for name in names}
    repro = subprocess.Popen(["dvc", "repro"], cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (root / "started").exists():
            assert repro.poll() is None and time.monotonic() < deadline, "dvc repro did not start its stage"
            time.sleep(0.1)
        proc = _nmt(root, "profile", "demo")
        assert proc.returncode == 1
        assert proc.stderr.splitlines() == [
            f"error: .dvc/tmp/rwlock: a running DVC stage reads params.yaml (pid {repro.pid}: "
            f"{shutil.which('dvc')} repro); wait for it to "
            "end or stop it, then run `nmt profile demo` again"]
        assert {name: (root / name).read_bytes() for name in before} == before
        assert not list(root.glob("params.yaml.*"))
    finally:
        os.killpg(repro.pid, signal.SIGKILL)
        repro.wait()
    assert _nmt(root, "profile", "demo").returncode == 0  # DVC's lock is free again
    assert active_profile(root) == "demo"


def test_the_switch_is_refused_while_a_dvc_command_holds_dvcs_repository_lock(tmp_path: Path) -> None:
    """Between stages (and for `dvc status`, `dvc commit`...) DVC holds .dvc/tmp/lock itself, through its Repo.lock."""
    root = init_git_dvc(tmp_path / "repo")
    shutil.copytree(REPO / "profiles", root / "profiles")
    write_profile("paper", root)
    params = (root / "params.yaml").read_bytes()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from dvc.repo import Repo; r = Repo(sys.argv[1]); "
                               "r.lock.lock(); print('held', flush=True); sys.stdin.read()", str(root)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        proc = _nmt(root, "profile", "demo")
        (line,) = proc.stderr.splitlines()  # the holder's command line, cut at 120 characters
        assert proc.returncode == 1 and line.startswith(
            f"error: .dvc/tmp/lock: a DVC command holds this checkout (pid {holder.pid}: "
            f"{Path(sys.executable).name} -c import sys; from dvc.repo import Repo;")
        assert line.endswith("); wait for it to end or stop it, then run `nmt profile demo` again")
        assert (root / "params.yaml").read_bytes() == params
    finally:
        holder.communicate("", timeout=30)


def test_each_profile_gets_its_own_dvc_link_record_and_a_users_site_cache_dir_is_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """DVC's `checkout` deletes the links its record holds that dvc.yaml does not name: one record per profile
    (core.site_cache_dir) keeps it from deleting another profile's outputs (tests/pipeline/test_dvc_experiments.py
    runs it); a value the user set is theirs."""
    from dvc.config import Config

    root = init_git_dvc(tmp_path / "repo")
    shutil.copytree(REPO / "profiles", root / "profiles")
    local = Config(dvc_dir=str(root / ".dvc"))
    write_profile("tiny", root)
    tiny = local.load_one("local")["core"]["site_cache_dir"]
    write_profile("demo", root)
    demo = local.load_one("local")["core"]["site_cache_dir"]
    assert Path(tiny).name == "tiny" and Path(demo).name == "demo" and Path(tiny).parent == Path(demo).parent
    subprocess.run(["dvc", "config", "--local", "core.site_cache_dir", str(tmp_path / "mine")], cwd=root, check=True)
    write_profile("tiny", root)
    assert local.load_one("local")["core"]["site_cache_dir"] == str(tmp_path / "mine")
    assert f"{root / '.dvc' / 'config.local'} sets core.site_cache_dir; kept it" in caplog.text

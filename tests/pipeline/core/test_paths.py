"""Where outputs may go: the params layout (inside the project, no overlaps, no other profile's folders), the
output options of commands, and the marker rule of :func:`pipeline.core.owned.atomic_path`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import load_params
from pipeline.core.errors import ConfigError, OutputError
from pipeline.core.owned import MARKER, atomic_path
from pipeline.core.paths import layout_problems, output_problem
from pipeline.project.profiles import merged_profile, write_profile
from tests.helpers.paths import REPO


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with this checkout's profiles/ and the tiny profile as params.yaml."""
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    write_profile("tiny", tmp_path)
    return tmp_path


def _load_with(project: Path, **paths: str) -> str:
    data = yaml.safe_load((project / "params.yaml").read_text(encoding="utf-8"))
    data["paths"].update(paths)
    (project / "params.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_params(project / "params.yaml")
    return str(err.value)


def test_every_tracked_profile_passes(project: Path) -> None:
    for name in ("paper", "paper-big", "demo", "multi30k", "tiny"):
        assert layout_problems(merged_profile(name, REPO)["paths"], REPO, name) == [], name


@pytest.mark.parametrize("value", ["/", "/etc", "/tmp/elsewhere"])
def test_an_absolute_path_outside_the_project_is_refused(project: Path, value: str) -> None:
    message = _load_with(project, clean=value)
    assert f"paths.clean: {value} lies outside {project}" in message and "\n" not in message


def test_paths_that_overlap_each_other_are_refused(project: Path) -> None:
    message = _load_with(project, model="runs/tiny/train")
    assert "paths.model (runs/tiny/train) and paths.train (runs/tiny/train) overlap" in message
    message = _load_with(project, model="runs/tiny/train/model")
    assert "paths.model (runs/tiny/train/model) and paths.train (runs/tiny/train) overlap" in message


def test_another_profiles_folders_are_refused_but_a_shared_dataset_is_not(project: Path) -> None:
    message = _load_with(project, bpe="runs/demo")
    assert "paths.bpe (runs/demo) overlaps profile demo's paths." in message
    assert "profiles/demo.yaml" in message
    data = yaml.safe_load((project / "params.yaml").read_text(encoding="utf-8"))
    data["paths"].update(raw="data/multi30k/raw", clean="data/multi30k/clean", bpe="data/multi30k/bpe",
                         shards="data/multi30k/shards")  # demo's and multi30k's data folders, the same keys
    (project / "params.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    assert load_params(project / "params.yaml").paths.raw == "data/multi30k/raw"
    assert "overlaps profile demo's paths.raw" in _load_with(project, clean="data/multi30k/raw")


def test_the_profile_switch_refuses_a_profile_that_overlaps_another(project: Path) -> None:
    (project / "profiles" / "tiny.yaml").write_text(
        (project / "profiles" / "tiny.yaml").read_text(encoding="utf-8").replace("bpe: data/tiny/bpe", "bpe: runs/demo"),
        encoding="utf-8")
    before = (project / "params.yaml").read_bytes()
    with pytest.raises(ConfigError, match=r"paths.bpe \(runs/demo\) overlaps profile demo's"):
        write_profile("tiny", project)
    assert (project / "params.yaml").read_bytes() == before


def test_output_options_never_name_the_current_folder_the_checkout_git_or_an_input(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "runs" / "model" / "averaged.pt"
    assert output_problem(".", inputs=[model]) == ". is the current folder"
    assert "is the checkout" in output_problem(REPO)
    assert "is the checkout" in output_problem("/")
    assert output_problem(REPO / ".git" / "x") == f"{REPO / '.git' / 'x'} lies inside .git"
    assert output_problem("runs/model", inputs=[model]) == f"runs/model is or holds the input {model}"
    assert output_problem("runs/model-ct2", inputs=[model]) is None


def test_a_folder_output_replaces_only_a_folder_it_wrote_for_the_same_role(tmp_path: Path) -> None:
    out = tmp_path / "clean"
    with atomic_path(out, role="clean") as tmp:
        tmp.mkdir()
        (tmp / "train.en").write_text("first\n")
    assert json.loads((out / MARKER).read_text()) == {"role": "clean", "entries": {"train.en": 6}}
    with atomic_path(out, role="clean") as tmp:  # its own folder: replaced
        tmp.mkdir()
        (tmp / "train.en").write_text("second\n")
    assert (out / "train.en").read_text() == "second\n"
    with pytest.raises(OutputError, match=r"clean: refusing to replace this folder: it is not a bpe folder this "
                                          r"project wrote \(its \.nmt-output says 'clean'\)"):
        with atomic_path(out, role="bpe") as tmp:
            tmp.mkdir()
    assert (out / "train.en").read_text() == "second\n"


def test_a_folder_a_user_made_is_never_replaced(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine\n")
    built = []
    with pytest.raises(OutputError, match=r"mine: refusing to replace this folder: .* holds no \.nmt-output marker"):
        with atomic_path(mine, role="clean") as tmp:  # refused before any work is done
            built.append(tmp)
    assert built == [] and (mine / "keep.txt").read_text() == "mine\n"
    with pytest.raises(OutputError, match="refusing to replace this folder"):
        with atomic_path(mine) as tmp:  # a file output onto a folder
            tmp.write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary sibling left either
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(OutputError, match="link: is a symbolic link"):
        with atomic_path(link, role="clean") as tmp:
            tmp.mkdir()
    assert (mine / "keep.txt").read_text() == "mine\n"


def _built(out: Path, files: dict[str, str], role: str = "clean") -> None:
    with atomic_path(out, role=role) as tmp:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)


@pytest.mark.parametrize(("change", "why"), [
    (lambda out: (out / "notes.txt").write_text("mine\n"), r"it holds notes\.txt, which its \.nmt-output does not list"),
    (lambda out: (out / "sub" / "a.en").write_text("longer text\n"), r"it holds sub/a\.en, which its \.nmt-output"),
    (lambda out: (out / "sub" / "x").mkdir(), r"it holds sub/x, which"),
    (lambda out: (out / MARKER).write_text("clean\n"), r"its \.nmt-output is an older version's, which lists no files"),
])
def test_a_folder_is_replaced_only_while_its_marker_lists_everything_in_it(tmp_path: Path, change, why: str) -> None:
    out = tmp_path / "clean"
    _built(out, {"train.en": "a\n", "sub/a.en": "b\n"})
    change(out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(OutputError, match=rf"clean: refusing to replace this folder: .*\({why}"):
        _built(out, {"train.en": "new\n"})
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean"]  # the staging folder went too


def test_a_folder_whose_files_were_deleted_is_still_ours(tmp_path: Path) -> None:
    out = tmp_path / "clean"
    _built(out, {"train.en": "a\n", "sub/a.en": "b\n"})
    (out / "sub" / "a.en").unlink()
    _built(out, {"train.en": "new\n"})
    assert (out / "train.en").read_text() == "new\n" and not (out / "sub").exists()

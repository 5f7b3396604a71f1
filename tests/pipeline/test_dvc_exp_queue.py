"""DVC's experiment queue on a built workspace, as DVC users run it: ``dvc exp run --queue`` with a two-value grid on
a training param, ``dvc queue start -j 1``. Each variant runs in a temporary workspace under ``.dvc/tmp/exps`` that
shares the repository's cache, so download, clean, bpe and encode come back from DVC's cache and run cache and only
train and what follows it run; ``dvc exp show`` then lists both variants with their test BLEU."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.core.env import MirrorChoice, data_mirror
from tests.helpers.tinyproject import built_env, copy_built

DATA_STAGES = ("download", "clean", "bpe", "encode")


def _dvc(repo: Path, *args: str, timeout: float = 300) -> str:
    done = subprocess.run(["dvc", *args], cwd=repo, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"dvc {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_a_queued_experiment_finds_the_mirror_beside_the_repository_it_was_queued_from(tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "data"
    shared.mkdir(parents=True)
    temp = tmp_path / "checkout" / ".dvc" / "tmp" / "exps" / "tmpabc"  # DVC's temporary workspace
    temp.mkdir(parents=True)
    assert data_mirror(temp, {}).location is None
    assert data_mirror(temp, {"DVC_ROOT": str(tmp_path / "checkout")}) == MirrorChoice(
        str(shared), "found beside the checkout, as NMT_DATA_MIRROR is unset")


@pytest.mark.slow
def test_a_queued_grid_reruns_no_data_stage_and_shows_both_variants_with_bleu(tiny_built: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    repo = copy_built(tiny_built, tmp_path / "work" / "project")
    (tmp_path / "work" / "shared").mkdir()
    (tmp_path / "work" / "shared" / "data").symlink_to(tiny_built / "mirror")  # found through DVC_ROOT if needed
    for name, value in built_env(tiny_built).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("NMT_DATA_MIRROR")
    _dvc(repo, "exp", "run", "--queue", "-S", "train.warmup_steps=6,8")
    queued = [line.split()[0] for line in _dvc(repo, "queue", "status").splitlines()[1:] if "Queued" in line]
    assert len(queued) == 2, _dvc(repo, "queue", "status")
    _dvc(repo, "queue", "start", "-j", "1")
    deadline = time.monotonic() + 900
    while any(word in (status := _dvc(repo, "queue", "status")) for word in ("Queued", "Running")):
        assert time.monotonic() < deadline, status
        time.sleep(5)
    assert status.count("Success") == 2, status
    shown = json.loads(_dvc(repo, "exp", "show", "--json"))
    rows = {rev["name"]: rev["data"] for entry in shown for group in entry.get("experiments") or []
            for rev in group["revs"]}
    assert len(rows) == 2, rows.keys()
    for name, data in rows.items():
        log = _dvc(repo, "queue", "logs", name)
        assert "Running stage 'train'" in log, log[-3000:]
        assert not [s for s in DATA_STAGES if f"Running stage '{s}'" in log], log[-3000:]
        assert all(f"Stage '{s}' is cached - skipping run" in log for s in DATA_STAGES), log[-3000:]  # run cache
        metrics = {Path(path).stem: body["data"] for path, body in data["metrics"].items()}
        assert isinstance(metrics["evaluate"]["test"]["bleu"], float), metrics
    warmups = sorted(data["params"]["params.yaml"]["data"]["train"]["warmup_steps"] for data in rows.values())
    assert warmups == [6, 8]

"""benchmarks/gpu.py, the script a lent GPU machine runs, dry-run on the CPU so it cannot rot (all but ``speed``, whose
compiled stage alone takes minutes on a CPU; ``speed --dry-run`` is run by hand before a device call).

The dry runs share one test and one data build: ``prepare`` makes the tiny profile's data from a synthetic
Multi30k mirror; ``check`` runs every step on it but ``demo`` (the determinism step runs that launcher too), on
the tiny profile with a few steps each (on the CPU bf16 autocast is off, so the precision curves agree exactly,
and CPU training is deterministic, so the determinism step finds bitwise equality); the same data then stands in
for the ``multi30k`` profile's, ``news`` prepares the news chain's data from a synthetic WMT14 mirror, and
``multi30k`` trains toy models for a few steps (its ``throughput`` step is the function ``check`` ran). Every
failed expectation is reported, by step.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.mirror import write_multi30k_mirror
from tests.helpers.paths import REPO

SCRIPT = REPO / "benchmarks" / "gpu.py"


def _script(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)


def _write_news_mirror(root: Path) -> Path:
    """``wmt14/dev`` and ``wmt14/test-full-txt`` as the shared data folder lays them out, 60 pairs a file."""
    from benchmarks.gpu_steps.multi30k import NEWS_TRAIN

    rng = random.Random(0)
    vocab = {lang: ["".join(rng.choices(letters, k=rng.randint(2, 8))) for _ in range(300)]
             for lang, letters in (("en", "abcdefghijklmnoprstuwy"), ("de", "abcdefghiklmnoprstuzäöü"))}
    names = [("dev", name) for name in (*NEWS_TRAIN, "newstest2013")] + [("test-full-txt", "newstest2014")]
    for folder, name in names:
        (root / "wmt14" / folder).mkdir(parents=True, exist_ok=True)
        for lang, words in vocab.items():
            lines = [" ".join(rng.choices(words, k=rng.randint(3, 9))) for _ in range(60)]
            (root / "wmt14" / folder / f"{name}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _results(out: Path, name: str) -> dict[str, Any]:
    path = out / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.is_dir() else []


def _tar_names(out: Path) -> set[str]:
    if not (out / "logs.tar.gz").is_file():
        return set()
    with tarfile.open(out / "logs.tar.gz") as tar:
        return set(tar.getnames())


def _rcs(run: dict[str, Any]) -> list[Any]:
    """The exit codes of a chain's train, average and evaluate."""
    return [run.get(stage, {}).get("rc") for stage in ("train", "average", "evaluate")]


def _check_expectations(done: subprocess.CompletedProcess, out: Path) -> dict[str, bool]:
    """What ``check --dry-run`` must give, by step."""
    result = _results(out, "gpu_check.json")
    tiny, pytest_step, throughput = (result.get(name, {}) for name in ("tiny", "pytest", "throughput"))
    zero_diff = {"bitwise_equal": True, "max_abs_diff": 0.0}
    return {
        "check: exit 0": done.returncode == 0,
        "check: every step, no error": "error" not in json.dumps(result) and set(result) >= {
            "env", "tiny", "pytest", "precision", "determinism", "throughput"},
        "check env": bool(result.get("env", {}).get("torch")),
        "check tiny": _rcs(tiny) == [0, 0, 0] and tiny.get("metrics", {}).get("train", {}).get("step") == 6,
        "check pytest (CUDA tests skipped)": pytest_step.get("rc") == 0 and "skipped" in pytest_step.get("summary", ""),
        "check precision": result.get("precision", {}).get("compare", {}).get("train_loss") == {
            "points": 3, "max_abs": 0.0, "max_rel": 0.0},
        "check determinism": result.get("determinism", {}).get("default", {}).get("a_vs_resumed") == {
            "model.pt": zero_diff, "optim.pt": zero_diff, "history_equal": True},
        "check throughput": throughput.get("rc") == 0
        and throughput.get("result", {}).get("tgt_tokens_per_s", {}).get("ours", 0) > 0,
        "check logs": {"logs/tiny-evaluate.log", "precision-fp32/plots/train.csv"} <= _tar_names(out),
        "check: only the JSON and the logs (a device call returns <= 8 files)":
            _names(out) == ["gpu_check.json", "logs.tar.gz"],
    }


def _multi30k_expectations(done: subprocess.CompletedProcess, out: Path) -> dict[str, bool]:
    """What ``multi30k --dry-run`` must give, by step."""
    result = _results(out, "gpu_multi30k.json")
    newstest = result.get("newstest", {})
    found = {
        "multi30k: exit 0": done.returncode == 0,
        "multi30k: its steps, no error, the commit": set(result) >= {"env", "sweep", "newstest"}
        and "error" not in json.dumps(result) and result.get("commit") == "abc1234",
        "multi30k newstest": newstest.get("sentences") == 20 and len(newstest.get("runs", [])) == 4,
        "multi30k logs": {"logs/news-evaluate.log", "multi30k/plots/train.csv"} <= _tar_names(out),
        "multi30k: only the JSON and the logs":
            _names(out) == ["gpu_multi30k.json", "logs.tar.gz"],
    }
    for chain in ("multi30k", "news"):
        run = result.get("sweep", {}).get(chain, {})
        metrics = run.get("metrics", {})
        found[f"multi30k sweep {chain}"] = (
            _rcs(run) == [0, 0, 0] and metrics.get("train", {}).get("step") == 10
            and metrics.get("evaluate.details", {}).get("chosen", {}).get("chosen_on") == "valid")
    return found


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_device_script_dry_runs_every_command_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "NMT_DATA_MIRROR": str(write_multi30k_mirror(tmp_path / "mirror")),
           "NMT_DATA_WORKERS": "1", "NMT_THREADS": "1", "OMP_NUM_THREADS": "1"}
    data, work = tmp_path / "data", tmp_path / "work"
    done = _script("prepare", "--data", str(data), "--profiles", "tiny", env=env)
    assert done.returncode == 0 and (data / "tiny" / "shards" / "manifest.json").is_file(), done.stderr[-3000:]

    check = _script("check", "--dry-run", "--data", str(data), "--out", str(tmp_path / "check"), "--work",
                    str(work / "check"), "--profiles", "tiny", "tiny", "--steps", "tiny", "pytest", "precision",
                    "determinism", "throughput", env=env)
    expected = _check_expectations(check, tmp_path / "check")

    (data / "tiny").rename(data / "multi30k")  # the same dataset with a vocabulary the small mirror can fill
    news = _script("news", "--data", str(data), "--mirror", str(_write_news_mirror(tmp_path / "shared")),
                   "--dry-run", env=env)
    expected["news: exit 0, the data and newstest2014"] = news.returncode == 0 and (
        data / "news" / "shards" / "manifest.json").is_file() and (data / "newstest" / "newstest2014.de").is_file()
    m30k = _script("multi30k", "--dry-run", "--data", str(data), "--out", str(tmp_path / "m30k"), "--work",
                   str(work / "m30k"), "--chains", "multi30k", "news", "--steps", "sweep", "newstest", "--commit",
                   "abc1234", env=env)
    expected.update(_multi30k_expectations(m30k, tmp_path / "m30k"))

    failed = [name for name, ok in expected.items() if not ok]
    logs = "\n".join(f"--- {name}\n{p.stderr[-2000:]}" for name, p in (("check", check), ("news", news),
                                                                          ("multi30k", m30k)) if p.returncode)
    assert not failed, f"failed: {failed}\n{logs}"


def test_news_data_without_the_shared_folder_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    done = _script("news", "--data", str(data), "--mirror", str(tmp_path / "nowhere"), env=dict(os.environ))
    assert done.returncode == 2
    assert "nowhere: no wmt14/dev and wmt14/test-full-txt folders here; pass --mirror" in done.stderr
    assert not data.exists()

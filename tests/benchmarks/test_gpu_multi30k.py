"""benchmarks/gpu_multi30k.py, a device call's script, dry-run on the CPU so it cannot rot.

The data comes from the scripts' own preparation commands run on synthetic mirrors (Multi30k from the
tests' helper with the tiny profile's data settings, WMT14's news sets written here); the dry run trains toy
models for a few steps.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.helpers.mirror import write_multi30k_mirror
from tests.helpers.paths import REPO



def _write_news_mirror(root: Path) -> Path:
    """``wmt14/dev`` and ``wmt14/test-full-txt`` as the shared data folder lays them out, 60 pairs a file."""
    from benchmarks.gpu_multi30k import NEWS_TRAIN

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


def _script(name: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / name), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_multi30k_device_script_dry_runs_its_steps_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "NMT_DATA_MIRROR": str(write_multi30k_mirror(tmp_path / "mirror")),
           "NMT_CLEAN_WORKERS": "1", "NMT_ENCODE_WORKERS": "1", "NMT_THREADS": "1", "OMP_NUM_THREADS": "1"}
    data, out, work = tmp_path / "data", tmp_path / "out", tmp_path / "work"
    done = _script("gpu_check.py", "prepare", "--data", str(data), "--profiles", "tiny", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (data / "tiny").rename(data / "multi30k")  # the same dataset with a vocabulary the small mirror can fill
    news = _write_news_mirror(tmp_path / "shared")
    done = _script("gpu_multi30k.py", "news", "--data", str(data), "--mirror", str(news), "--dry-run", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (data / "news" / "shards" / "manifest.json").is_file() and (data / "newstest" / "newstest2014.de").is_file()
    done = _script("gpu_multi30k.py", "run", "--dry-run", "--data", str(data), "--out", str(out), "--work", str(work),
                   "--chains", "multi30k", "news", "--commit", "abc1234", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "gpu_multi30k.json").read_text(encoding="utf-8"))
    assert "error" not in json.dumps(result) and result["commit"] == "abc1234"
    for chain in ("multi30k", "news"):
        assert [result["sweep"][chain][s]["rc"] for s in ("train", "average", "evaluate")] == [0, 0, 0], chain
        assert result["sweep"][chain]["metrics"]["train"]["step"] == 10
        assert result["sweep"][chain]["metrics"]["evaluate.details"]["chosen"]["chosen_on"] == "valid"
    assert result["newstest"]["sentences"] == 20 and len(result["newstest"]["runs"]) == 4
    assert result["throughput"]["rc"] == 0 and result["throughput"]["result"]["tgt_tokens_per_s"]["ours"] > 0
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"logs/news-evaluate.log", "multi30k/plots/train.csv"} <= set(tar.getnames())
    assert sorted(p.name for p in out.iterdir()) == ["gpu_multi30k.json", "logs.tar.gz"]


def test_news_data_without_the_shared_folder_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    done = _script("gpu_multi30k.py", "news", "--data", str(data), "--mirror", str(tmp_path / "nowhere"),
                   env=dict(os.environ))
    assert done.returncode == 2
    assert "nowhere: no wmt14/dev and wmt14/test-full-txt folders here; pass --mirror" in done.stderr
    assert not data.exists()

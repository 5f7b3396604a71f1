"""What DVC users see of a run: ``dvc metrics show`` fits a terminal, ``dvc plots show`` draws the intended curves.

Each test builds a temporary git + DVC repository with this checkout's dvc.yaml and a profile's
params.yaml, writes the files the stages write (through the code that writes them) and asks real DVC.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.core import stages
from pipeline.project.profiles import write_profile
from pipeline.tracking.harness import write_metrics
from pipeline.training.curves import write_curves
from pipeline.training.logs import history_csv
from tests.helpers.history import training_history
from tests.helpers.paths import REPO
from tests.helpers.repoutil import init_git_dvc

pytestmark = pytest.mark.slow

TIMINGS = ("seconds", "per_s", "per_second")


def _project(root: Path, profile: str) -> dict:
    """A git + DVC repo with this dvc.yaml and ``profile`` as params.yaml; returns its ``paths``."""
    init_git_dvc(root)
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    write_profile(profile, REPO, target=root / "params.yaml")
    return yaml.safe_load((root / "params.yaml").read_text(encoding="utf-8"))["paths"]


def _dvc(root: Path, *args: str) -> str:
    done = subprocess.run(["dvc", *args], cwd=root, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _scores(bleu: float) -> dict:
    """One set of the evaluate stage's record, at full float precision, with its timings and strings."""
    return {"bleu": bleu + 0.123456789012, "bleu_intl": bleu, "bleu_lc": bleu, "bleu_tok_split": bleu,
            "chrf2": 57.1234567890123, "ppl": 4.71234567890123, "nll": 1.55, "decode_seconds": 812.25,
            "sentences_per_second": 3.75, "sentences": 3003, "beam": 4, "alpha": 0.6,
            "signatures": {"bleu": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.5.1"}}


# The largest values a paper-size run reports: 100k steps of 25k tokens, full-precision floats.
RECORDS = {
    "train": {"step": 100000, "epoch": 19, "tokens_seen": 2_512_345_678, "train_loss": 1.912345678901,
              "valid_ppl": 4.912345678901, "seconds": 43210.5, "tgt_tokens_per_s": 58123.4, "device": "cuda"},
    "evaluate": {"valid": _scores(25.8), "test": _scores(27.3), "valid_newest": _scores(25.1),
                 "chosen": {"beam": 4, "alpha": 0.6}, "seconds": 2400.0},
}


@pytest.mark.parametrize("profile", ["tiny", "paper"])
def test_metrics_show_fits_120_columns_without_timings(tmp_path: Path, profile: str) -> None:
    paths = _project(tmp_path / "repo", profile)
    root = tmp_path / "repo"
    for name in stages.NAMES:
        summary = stages.summary(name, RECORDS.get(name, {"seconds": 1.0, "pairs": 3}))
        if summary is not None:
            write_metrics(root / stages.metrics_file(paths["metrics"], name), summary)
    written = sorted(p.name for p in (root / paths["metrics"]).iterdir())
    assert written == ["evaluate.json", "train.json"]

    shown = _dvc(root, "metrics", "show").rstrip("\n").splitlines()
    assert len(shown) == 3, shown  # header + train + evaluate
    assert max(len(line) for line in shown) <= 120, "\n".join(shown)
    columns = shown[0].split()
    assert columns[0] == "Path" and not any(t in c for c in columns for t in TIMINGS), columns
    assert sorted(columns[1:]) == sorted(k for n in ("train", "evaluate") for k in stages.get(n).metrics)
    as_json = json.loads(_dvc(root, "metrics", "show", "--json"))
    data = next(iter(as_json.values()))["data"]
    evaluate = data[f"{paths['metrics']}/evaluate.json"]["data"]
    assert evaluate == {"valid": {"bleu": RECORDS["evaluate"]["valid"]["bleu"], "chrf2": 57.1234567890123,
                                  "ppl": 4.71234567890123},
                        "test": {"bleu": RECORDS["evaluate"]["test"]["bleu"], "chrf2": 57.1234567890123}}


def test_a_metric_the_record_lacks_is_left_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert stages.summary("train", {"step": 7, "tokens_seen": None}) == {"step": 7}
    assert "stage train reported no number tokens_seen (got None): left out of its DVC metrics" in caplog.text
    assert stages.summary("download", {"pairs": {"train": 3}}) is None  # not a compared stage: no <stage>.json


def _plotted(plot: list[dict]) -> set[tuple[str, str]]:
    """(file, column) of every point of a plot in ``dvc plots show --json`` (file "" when the plot has one
    series); asserts each point's y is a number (an empty CSV cell would be '')."""
    content = plot[0]["content"]
    y = content["layer"][0]["encoding"]["y"]["field"]
    pairs = set()
    for point in content["data"]["values"]:
        float(point[y])
        file, _, column = point.get("filename::field", f"::{y}").partition("::")
        pairs.add((file, column))
    return pairs


def test_plots_show_draws_train_and_valid_loss_perplexity_and_lr(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    paths = _project(root, "tiny")
    train_csv = root / paths["plots"] / "train.csv"
    train_csv.parent.mkdir(parents=True)
    train_csv.write_text(history_csv(training_history(steps=60, valid_every=20, log_every=5)), encoding="utf-8")
    write_curves(train_csv)

    plots = json.loads(_dvc(root, "plots", "show", "--json"))["data"]
    assert set(plots) == {"loss", "perplexity", "learning_rate", f"{paths['plots']}/train.png"}
    assert _plotted(plots["loss"]) == {("train.csv", "train_loss"), ("valid.csv", "valid_loss")}
    assert _plotted(plots["perplexity"]) == {("train.csv", "train_ppl"), ("valid.csv", "valid_ppl")}
    assert _plotted(plots["learning_rate"]) == {("", "lr")}
    points = plots["loss"][0]["content"]["data"]["values"]
    valid = [p for p in points if p["filename::field"] == "valid.csv::valid_loss"]
    assert [int(p["step"]) for p in valid] == [20, 40, 60]
    for name, label in (("loss", "loss"), ("perplexity", "perplexity"), ("learning_rate", "learning rate")):
        assert plots[name][0]["content"]["layer"][0]["encoding"]["y"]["title"] == label
    image = plots[f"{paths['plots']}/train.png"]
    assert image[0]["type"] == "image" and image[0]["url"].endswith("train.png")
    assert Path(image[0]["url"]).read_bytes() == (root / paths["plots"] / "train.png").read_bytes()

"""The pictures a user opens: the training curves (``train.png``) and a sentence's cross-attention.

Each is drawn by the code that draws it in a run, read back as pixels, and checked to be an image of
the expected size with something drawn on it.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from pipeline.cli import main
from pipeline.core.errors import PipelineError
from pipeline.inference.decoding import load_translator
from pipeline.inference.translate import prepare_lines
from pipeline.training import curves
from pipeline.training.logs import history_csv
from tests.helpers.history import training_history
from tests.helpers.models import make_averaged


def _drawn(png: Path) -> np.ndarray:
    """The PNG's pixels (height x width x channels); asserts it is not one flat colour."""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(png)
    rgb = pixels[..., :3]
    assert rgb.std() > 0.05, "a blank picture"
    assert (rgb.min(axis=2) < 0.9).mean() > 0.01, "almost nothing drawn"  # non-white pixels: lines, text, heatmap
    return pixels


def test_train_png_shows_curves_at_its_fixed_size(tmp_path: Path) -> None:
    train_csv = tmp_path / "plots" / "train.csv"
    train_csv.parent.mkdir()
    train_csv.write_text(history_csv(training_history(steps=200, valid_every=50, log_every=10)), encoding="utf-8")
    valid_csv, png = curves.write_curves(train_csv)
    assert png == tmp_path / "plots" / "train.png"
    pixels = _drawn(png)
    assert pixels.shape[:2] == (curves.FIG_INCHES[1] * curves.DPI, curves.FIG_INCHES[0] * curves.DPI) == (400, 1200)
    with open(valid_csv, encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [50, 100, 150, 200] and all(r["valid_ppl"] for r in rows)
    assert not list(png.parent.glob(".*.tmp"))  # written atomically: no temporary sibling left


def test_train_png_of_a_run_without_validation_yet(tmp_path: Path) -> None:
    train_csv = tmp_path / "train.csv"
    train_csv.write_text(history_csv(training_history(steps=30, valid_every=1000, log_every=10)), encoding="utf-8")
    valid_csv, png = curves.write_curves(train_csv)
    assert valid_csv.read_text(encoding="utf-8") == "step,valid_loss,valid_nll,valid_ppl\n"
    assert _drawn(png).shape[:2] == (400, 1200)


@pytest.mark.parametrize(("text", "message"), [
    (None, "train.csv: not found; rerun the train stage (`dvc repro train`)"),
    ("epoch,lr\n1,0.1\n", "train.csv: no 'step' column in its header; rerun the train stage (`dvc repro train`)"),
    ("step,lr\n10,0.1\n20,fast\n", "train.csv: line 3: column lr is not a number ('fast'); "
                                   "rerun the train stage (`dvc repro train`)"),
])
def test_a_bad_train_csv_is_one_line_naming_it(tmp_path: Path, text: str | None, message: str) -> None:
    train_csv = tmp_path / "train.csv"
    if text is not None:
        train_csv.write_text(text, encoding="utf-8")
    with pytest.raises(PipelineError) as err:
        curves.write_curves(train_csv)
    assert str(err.value) == f"{tmp_path}/{message}"
    assert not (tmp_path / "train.png").exists()


def test_attention_png_from_nmt_translate_is_a_heatmap_per_head(tmp_path: Path) -> None:
    model = make_averaged(tmp_path / "model", seed=3)
    src, out, png = tmp_path / "in.en", tmp_path / "out.de", tmp_path / "attention.png"
    src.write_text("a dog\n", encoding="utf-8")
    # At most 3 output pieces (+ </s>) and a short source: both axes keep the figure's minimum size
    # (4 x 3 inches per panel at 100 dpi, pipeline/inference/translate.py plot_cross_attention).
    assert main(["translate", "--model", str(model), "--input", str(src), "--output", str(out), "--beam", "2",
                 "--max-len-a", "0", "--max-len-b", "3", "--attention-png", str(png)]) == 0
    translator = load_translator(model, device="cpu")
    sources, _ = prepare_lines(translator, ["a dog"])
    assert len(sources[0]) <= 7  # source pieces with </s>: the width stays at its minimum
    heads = translator.model.cfg.n_heads
    cols = min(heads, 4)
    pixels = _drawn(png)
    assert pixels.shape[:2] == (300 * math.ceil(heads / cols), 400 * cols)

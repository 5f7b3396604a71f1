"""A rebuild gives the same model: the tiny profile run twice from scratch in two fresh folders.

Every stage from download to evaluate runs in-process (as ``dvc repro`` runs each ``python -m
pipeline.<stage>``) on a synthetic Multi30k-shaped mirror. No wall clock takes part in any decision,
so the averaged model must be byte-identical and the scores equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline import average, bpe, clean, download, encode, evaluate, train
from pipeline.project.profiles import write_profile
from tests.helpers.mirror import write_multi30k_mirror
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow
STAGES = (download, clean, bpe, encode, train, average, evaluate)


def _build(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder.mkdir()
    monkeypatch.chdir(folder)
    params = write_profile("tiny", REPO, folder / "params.yaml")
    for stage in STAGES:
        assert stage.main(["--params", str(params)]) == 0, stage.__name__
    return folder


def _scores(metrics: Any) -> Any:
    """evaluate.details.json without timings (the only numbers a machine's speed changes)."""
    if isinstance(metrics, dict):
        return {k: _scores(v) for k, v in metrics.items() if "seconds" not in k and "per_second" not in k}
    if isinstance(metrics, list):
        return [_scores(v) for v in metrics]
    return metrics


def test_tiny_profile_rebuilds_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMT_DATA_MIRROR", str(write_multi30k_mirror(tmp_path / "mirror")))
    monkeypatch.setenv("NMT_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    a, b = (_build(tmp_path / name, monkeypatch) for name in ("a", "b"))
    model = Path("runs/tiny/model/averaged.pt")
    assert (a / model).read_bytes() == (b / model).read_bytes()
    scores = [_scores(json.loads((d / "metrics/tiny/evaluate.details.json").read_text(encoding="utf-8")))
              for d in (a, b)]
    assert scores[0] == scores[1] and "bleu" in scores[0]["test"] and "bleu" in scores[0]["valid_newest"]
    for name in ("valid.hyp.de", "test.hyp.de", "valid.newest.hyp.de"):
        assert (a / "runs/tiny/eval" / name).read_bytes() == (b / "runs/tiny/eval" / name).read_bytes(), name

"""benchmarks/encode.py drives the real clean and encode stages (through the stage wrapper), so it cannot
silently fall behind their signatures: one tiny measurement of each."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import CORPUS, make_spm
from tests.helpers.paths import load_benchmark


def test_clean_and_encode_measurements_run_the_real_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMT_DATA_WORKERS", "1")
    bench = load_benchmark("encode")
    (tmp_path / "raw").mkdir()
    pairs = list(zip(CORPUS[0::2], CORPUS[1::2]))
    for split in ("train", "valid", "test"):
        (tmp_path / "raw" / f"{split}.en").write_text("".join(f"{en}\n" for en, _ in pairs), encoding="utf-8")
        (tmp_path / "raw" / f"{split}.de").write_text("".join(f"{de}\n" for _, de in pairs), encoding="utf-8")
    cleaned = bench.measure("clean", tmp_path, 1)
    assert cleaned["pairs"] == 3 * len(pairs) and cleaned["seconds"] > 0
    make_spm(tmp_path / "bpe")
    encoded = bench.measure("encode", tmp_path, 1)
    assert encoded["pairs"] > 0 and (tmp_path / "shards" / "manifest.json").is_file()
    assert (tmp_path / "metrics" / "encode.details.json").is_file()  # the wrapper's bookkeeping ran too

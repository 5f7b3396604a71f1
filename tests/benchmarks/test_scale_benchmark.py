"""benchmarks/synth_corpus.py and benchmarks/scale.py: the generator's corpus has the properties the scale
table relies on, its WMT14 mirror layout is what the download stage reads, and a small run of the benchmark
drives the real stage commands end to end, so neither can rot."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pipeline import clean, download
from pipeline.core.config import CleanConfig, DownloadConfig
from pipeline.core.stage import run_stage
from pipeline.core.textio import read_lines
from pipeline.data.sources import WMT14
from tests.helpers.paths import REPO, load_benchmark


@pytest.fixture(scope="module")
def synth():
    return load_benchmark("synth_corpus")


@pytest.fixture(scope="module")
def corpus(synth, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """25,000 pairs (two generator blocks) over 20,000 word types."""
    out = tmp_path_factory.mktemp("synth") / "raw"
    return out, synth.write_corpus(out, 25_000, types=20_000, valid=40, test=50)


def test_the_corpus_is_aligned_noisy_zipfian_and_a_prefix_of_larger_ones(synth, corpus: tuple[Path, dict],
                                                                        tmp_path: Path) -> None:
    out, info = corpus
    lines = {name: list(read_lines(out / name)) for name in ("train.en", "train.de", "valid.de", "test.en")}
    assert len(lines["train.en"]) == len(lines["train.de"]) == 25_000  # read_lines: valid UTF-8, no NUL
    assert (len(lines["valid.de"]), len(lines["test.en"])) == (40, 50)
    assert set(info["noise"]) == set(synth.NOISE_KINDS) and min(info["noise"].values()) > 40
    assert 0.015 < sum(info["noise"].values()) / 25_000 < 0.025
    words = Counter(w for line in lines["train.en"] for w in line.split())
    top = [count for _, count in words.most_common(100)]
    assert 5 < top[0] / top[9] < 20 and top[9] / top[99] > 5  # Zipf, s ≈ 1: rank 10 ≈ 1/10 of rank 1
    assert any(not line.isascii() for line in lines["train.de"][:100])  # umlauts: the NFC path of normalize
    small = tmp_path / "small"
    synth.write_corpus(small, 1_234, types=20_000, valid=40, test=50)
    assert list(read_lines(small / "train.de")) == lines["train.de"][:1_234]


def test_the_clean_stage_meets_every_kind_of_noise(corpus: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = corpus
    dropped = clean.stage(CleanConfig(), raw_dir=out, clean_dir=tmp_path / "clean")["train"]["dropped"]
    for rule in ("empty", "too_long", "ratio", "copy", "duplicate"):
        assert dropped[rule] > 0, (rule, dropped)
    text = (tmp_path / "clean" / "train.en").read_text(encoding="utf-8")
    assert "\t" not in text and "\x01" not in text and "\u200b" not in text  # controls normalised away


def test_the_mirror_layout_is_what_the_download_stage_reads(synth, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    scale = load_benchmark("scale")
    counts = (30, 50, 20)
    spec = dataclasses.replace(
        WMT14, train=tuple(dataclasses.replace(c, lines=n) for c, n in zip(WMT14.train, counts)),
        valid=tuple(dataclasses.replace(c, lines=7) for c in WMT14.valid),
        test=tuple(dataclasses.replace(c, lines=9) for c in WMT14.test))
    synth.write_corpus(tmp_path / "gen", sum(counts), types=5_000, valid=7, test=9)
    scale.write_mirror(tmp_path / "gen", tmp_path / "mirror", spec)
    monkeypatch.setenv("NMT_DATA_MIRROR", str(tmp_path / "mirror"))
    monkeypatch.setenv("NMT_DOWNLOAD_CACHE", str(tmp_path / "cache"))
    run_stage("download", lambda: download.stage(DownloadConfig(dataset="wmt14"), raw_dir=tmp_path / "raw",
                                                 sources=spec), metrics_dir=tmp_path / "metrics")
    for name in ("train.en", "train.de", "valid.en", "valid.de", "test.en", "test.de"):
        assert (tmp_path / "raw" / name).read_bytes() == (tmp_path / "gen" / name).read_bytes(), name


@pytest.mark.slow
def test_a_small_run_drives_the_real_stage_commands(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale.py"), "--quick", "--work", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (size,) = result["sizes"]
    assert size["corpus"]["pairs"] == 20_000
    assert list(size["stages"]) == ["clean", "bpe", "encode"]
    projected = result["projection_16_cores"]
    assert set(projected) == {"clean", "bpe", "encode"} and all(p["seconds"] > 0 for p in projected.values())
    for stage, r in size["stages"].items():
        assert r["seconds"] > 0 and r["peak_rss_mib_process"] > 10 and r["pairs"] > 15_000, stage
        assert 0 < r["cpu_s_main_thread"] <= r["cpu_s_busiest_thread"] <= r["cpu_s_total"], stage
    assert size["stages"]["encode"]["output_mb"] > 0 and size["stages"]["bpe"]["details"]["sentences"] > 0
    assert "| 20,000 |" in proc.stdout and [p.name for p in tmp_path.iterdir()] == ["scale.json"]

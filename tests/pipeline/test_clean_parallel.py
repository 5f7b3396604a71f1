"""Stage ``clean`` in blocks and worker processes: the output bytes and counts do not depend on either."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest

from pipeline import clean
from pipeline.core.config import CleanConfig
from pipeline.core.data_details import CleanDetails
from pipeline.core.errors import ConfigError, DataError
from pipeline.data import filters
from tests.helpers.clean import write_raw

WORDS = ["a", "cat", "dog", "the", "Über", "café", "e\u0301", "x\u200by", "tab\tbed", "big", ""]


def corpus(n: int, seed: int) -> list[tuple[str, str]]:
    """Pairs from a tiny vocabulary: duplicates far apart (across blocks), every rule, Unicode to normalise."""
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.choice([0, 1, 2, 3, 4, 9])))

    pairs = [(sentence(), sentence()) for _ in range(n)]
    pairs += [pairs[rng.randrange(len(pairs))] for _ in range(n // 4)]  # exact duplicates, spread out
    rng.shuffle(pairs)
    return pairs


def run(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, *, workers: int, rows: int) -> CleanDetails:
    monkeypatch.setenv("NMT_DATA_WORKERS", str(workers))
    monkeypatch.setattr(filters, "BLOCK_ROWS", rows)
    return clean.stage(CleanConfig(max_ratio=2.0), raw_dir=tmp_path / "raw", clean_dir=tmp_path / name)


def test_blocks_and_workers_do_not_change_the_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    valid = corpus(30, 2)
    write_raw(tmp_path / "raw", {"train": corpus(400, 1), "valid": valid, "test": corpus(30, 3)})
    serial = run(tmp_path, "serial", monkeypatch, workers=1, rows=1 << 20)
    blocks = run(tmp_path, "blocks", monkeypatch, workers=2, rows=7)
    assert serial == blocks
    assert serial.train.dropped and serial.train.dropped["duplicate"] > 20 and serial.train.dropped["ratio"] > 0
    for name in ("train.en", "train.de", "valid.en", "valid.de", "test.en", "test.de"):
        assert (tmp_path / "serial" / name).read_bytes() == (tmp_path / "blocks" / name).read_bytes(), name
    assert serial.valid.pairs_out == len(valid) and (serial.valid.blank or 0) > 0  # valid keeps every line


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_line_in_a_later_block_is_named_and_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     workers: int) -> None:
    pairs = corpus(60, 4)
    write_raw(tmp_path / "raw", {"train": pairs, "valid": pairs[:5], "test": pairs[:5]})
    raw = (tmp_path / "raw" / "train.de").read_bytes().split(b"\n")
    raw[40] = b"caf\xe9 latin-1"  # line 41, in the 6th block of 7
    (tmp_path / "raw" / "train.de").write_bytes(b"\n".join(raw))
    with pytest.raises(DataError, match=r"train\.de:41: invalid UTF-8 at byte 3 of the line; re-encode"):
        run(tmp_path, "out", monkeypatch, workers=workers, rows=7)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_a_temp_dir_too_long_for_the_workers_socket_is_named_before_any_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """multiprocessing's forkserver socket lives under TMPDIR; Linux caps its path at 107 bytes."""
    pairs = corpus(60, 5)
    write_raw(tmp_path / "raw", {"train": pairs, "valid": pairs[:5], "test": pairs[:5]})
    deep = tmp_path / ("t" * (100 - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    expected = (f"TMPDIR={deep} is {len(str(deep))} bytes long: the worker processes' socket under it would pass "
                "Linux's 107-byte limit; set TMPDIR to a folder of at most 75 bytes (e.g. /tmp), or "
                "NMT_DATA_WORKERS=1 (no worker processes)")
    with pytest.raises(ConfigError) as info:
        run(tmp_path, "out", monkeypatch, workers=2, rows=7)
    assert str(info.value) == f"environment: {expected}"
    assert not (tmp_path / "out").exists()
    assert run(tmp_path, "serial", monkeypatch, workers=1, rows=7).train.pairs_out > 0  # the way out works

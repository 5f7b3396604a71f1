"""The bpe stage's sample, read a block at a time, is exactly the seeded choice of lines it documents."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.core.errors import DataError
from pipeline.core.textio import read_lines
from pipeline.data import sample as bpe_sample


def write(path: Path, lines: list[str]) -> Path:
    path.write_bytes("".join(f"{line}\n" for line in lines).encode())
    return path


@pytest.mark.parametrize("k", [0, 5, 40, 10**7])
def test_block_reading_gives_the_seeded_lines_in_file_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            k: int) -> None:
    monkeypatch.setattr(bpe_sample, "READ_BLOCK", 7)
    files = [write(tmp_path / "a", [f"a{i}" if i % 9 else "" for i in range(30)]),
             write(tmp_path / "b", [f"b{i} ü" for i in range(23)])]
    every = [line for f in files for line in read_lines(f)]
    chosen = bpe_sample.sample_indices(len(every), k, seed=3).tolist()
    sample = bpe_sample.Sample(files, k, seed=3)
    assert list(sample) == [every[i] for i in chosen if every[i]]
    assert sample.count == sum(1 for i in chosen if every[i])
    assert list(sample) == list(bpe_sample.Sample(files, k, seed=3))  # iterating again gives the same lines


def test_a_bad_line_in_a_later_block_keeps_its_file_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bpe_sample, "READ_BLOCK", 4)
    good = write(tmp_path / "train.en", [f"w{i}" for i in range(12)])
    bad = tmp_path / "train.de"
    bad.write_bytes(b"".join(b"x\n" if i != 9 else b"caf\xe9\n" for i in range(12)))
    sample = bpe_sample.Sample([good, bad], 10**7, seed=1)
    with pytest.raises(DataError, match=re.escape(f"{bad}:10: invalid UTF-8 at byte 3 of the line")):
        list(sample)
    assert sample.error is not None

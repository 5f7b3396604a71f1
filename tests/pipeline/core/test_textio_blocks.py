"""``line_offsets`` + ``read_line_block`` read a file exactly as ``read_lines`` does, errors included."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.errors import DataError
from pipeline.core.textio import line_offsets, read_line_block, read_lines

TEXTS = [
    b"",
    b"\n",
    b"one",
    b"one\n",
    b"one\n\n\nfour\n",
    "α\nβγ\n\n δ \r\nε\u2028ζ\nlast without newline".encode(),
]


@pytest.mark.parametrize("data", TEXTS)
@pytest.mark.parametrize("every", [1, 2, 3, 5])
def test_blocks_put_together_are_read_lines(tmp_path: Path, data: bytes, every: int) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(data)
    offsets, n = line_offsets(path, every)
    lines = list(read_lines(path))
    assert n == len(lines)
    ends = offsets[1:] + [-1]
    blocks = [read_line_block(path, start, end, k * every) for k, (start, end) in enumerate(zip(offsets, ends))]
    assert [line for block in blocks for line in block] == lines
    assert all(len(b) == min(every, n - k * every) for k, b in enumerate(blocks) if k * every < n)


@pytest.mark.parametrize("bad, message", [
    (b"caf\xe9", "f.txt:4: invalid UTF-8 at byte 3 of the line"),
    (b"nul\x00here", "f.txt:4: NUL byte at byte 3 of the line"),
])
def test_a_block_names_the_same_line_and_byte_as_read_lines(tmp_path: Path, bad: bytes, message: str) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(b"a\nb\nc\n" + bad + b"\ne\n")
    with pytest.raises(DataError, match=message):
        list(read_lines(path))
    offsets, _ = line_offsets(path, 2)
    with pytest.raises(DataError, match=message):
        read_line_block(path, offsets[1], offsets[2], 2)

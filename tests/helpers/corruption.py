"""Damage a ``torch.save`` file the way bit rot or a bad copy does: same size, other bytes."""

from __future__ import annotations

import zipfile
from pathlib import Path


def flip_in_largest_record(path: Path, n: int = 64) -> None:
    """Invert ``n`` bytes in the middle of the largest record (a tensor's storage) of the zip ``path``.

    The file keeps its size and still unpickles: only the tensor values change.
    """
    with zipfile.ZipFile(path) as zf:
        info = max(zf.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len + max(0, info.file_size // 2 - n // 2)
    assert info.file_size >= n, f"{path}: largest record holds {info.file_size} bytes, fewer than {n}"
    for i in range(start, start + n):
        data[i] ^= 0xFF
    size = path.stat().st_size
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size

"""Raw text as the download stage leaves it, for the ``clean`` stage and the stages after it."""

from __future__ import annotations

from pathlib import Path


def write_raw(raw: Path, splits: dict[str, list[tuple[str, str]]]) -> None:
    """Write ``<raw>/<split>.{en,de}`` from pairs (bytes written exactly, each line + ``\\n``)."""
    raw.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        for side, lang in enumerate(("en", "de")):
            (raw / f"{split}.{lang}").write_bytes("".join(p[side] + "\n" for p in pairs).encode("utf-8"))

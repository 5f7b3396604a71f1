"""Stage ``clean``: normalise every split, filter training pairs.

Reads ``<raw>/{train,valid,test}.{en,de}`` and writes ``<clean>/{train,valid,test}.{en,de}`` plus
``<metrics>/clean.json``. Every line of every split goes through :func:`normalize`. Only training
pairs are filtered (empty, too short/long, length ratio, source == target copies, exact
duplicates); valid and test keep every line, empty ones included, so their line counts match the
raw files and the references BLEU is computed against.

Deduplication keeps one 16-byte digest per kept pair (:class:`DigestSet`), never the text, so the
stage streams corpora of any size.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.core.config import CleanConfig, Params
from pipeline.core.errors import DataError
from pipeline.core.stage import stage_main
from pipeline.core.textio import atomic_path, count_lines, read_lines
from pipeline.data.normalize import normalize

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
LANGS = ("en", "de")
RULES = ("empty", "too_short", "too_long", "ratio", "copy", "duplicate")
_BATCH = 16384  # pairs per batch: large enough for numpy, small enough to keep RSS flat
_LOG_EVERY_S = 10.0


def _n_words(line: str) -> int:
    """Words of a normalised line (single spaces, no leading/trailing space)."""
    return line.count(" ") + 1 if line else 0


def pair_digest(src: str, tgt: str) -> bytes:
    """16-byte digest of a normalised pair (``\\n`` cannot occur inside a line: unambiguous)."""
    return hashlib.blake2b(f"{src}\n{tgt}".encode(), digest_size=16).digest()


class DigestSet:
    """A set of 16-byte digests in an open-addressing numpy table (~34 bytes per entry).

    A Python ``set`` of ``bytes`` costs ~100 bytes per entry; this keeps the memory of
    deduplicating 4.5M pairs near 150 MB. Insertion is batched and vectorised.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._keys = np.zeros((capacity, 2), dtype=np.uint64)
        self._used = np.zeros(capacity, dtype=bool)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _grow(self) -> None:
        old_keys, old_used = self._keys, self._used
        cap = 2 * len(old_used)
        self._keys = np.zeros((cap, 2), dtype=np.uint64)
        self._used = np.zeros(cap, dtype=bool)
        self._n = 0
        step = 1 << 18  # rehash in chunks: no full copy of the old keys
        for i in range(0, len(old_used), step):
            self._insert_unique(old_keys[i:i + step][old_used[i:i + step]])

    def _insert_unique(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct ``keys`` [m, 2]; return a mask of those that were not present."""
        mask = len(self._used) - 1
        slot = (keys[:, 0] & np.uint64(mask)).astype(np.int64)
        new = np.zeros(len(keys), dtype=bool)
        todo = np.arange(len(keys))
        while len(todo):
            s = slot[todo]
            used = self._used[s]
            same = used & np.all(self._keys[s] == keys[todo], axis=1)
            # Empty slot: the first claimant (lowest index) takes it; the others probe again.
            empty = ~used
            claim = np.zeros(len(todo), dtype=bool)
            if empty.any():
                cand = np.flatnonzero(empty)
                _, first = np.unique(s[cand], return_index=True)
                claim[cand[first]] = True
                won = todo[claim]
                self._keys[slot[won]] = keys[won]
                self._used[slot[won]] = True
                new[won] = True
                self._n += len(won)
            keep = ~(same | claim)
            todo = todo[keep]
            slot[todo] = (slot[todo] + 1) & mask
        return new

    def add_batch(self, digests: list[bytes]) -> np.ndarray:
        """Add digests in order; return a bool mask, True where a digest is seen for the first time."""
        if not digests:
            return np.zeros(0, dtype=bool)
        keys = np.frombuffer(b"".join(digests), dtype=np.uint64).reshape(-1, 2)
        _, first = np.unique(keys.view(np.dtype((np.void, 16))).ravel(), return_index=True)
        first.sort()
        while (self._n + len(first)) * 2 > len(self._used):
            self._grow()
        result = np.zeros(len(keys), dtype=bool)
        result[first] = self._insert_unique(keys[first])
        return result


def _raw_files(raw_dir: Path, split: str) -> tuple[Path, Path, int]:
    """The aligned raw files of ``split`` and their line count (checked to exist and to agree)."""
    src, tgt = (raw_dir / f"{split}.{lang}" for lang in LANGS)
    for path in (src, tgt):
        if not path.is_file():
            raise DataError(f"{path}: missing; run `dvc repro download` first")
    n_src, n_tgt = count_lines(src), count_lines(tgt)
    if n_src != n_tgt:
        raise DataError(f"{src} has {n_src} lines but {tgt} has {n_tgt}: the files are not aligned; "
                        "fix or re-download them (`dvc repro download`)")
    if n_src == 0:
        need = "nothing to train on" if split == "train" else f"the {split} set is needed for validation and BLEU"
        raise DataError(f"{src} and {tgt} are empty: {need}; check or rerun the download stage (`dvc repro download`)")
    return src, tgt, n_src


def _pairs(src: Path, tgt: Path) -> Iterator[tuple[str, str]]:
    """Zip two aligned files, normalising both sides; DataError if one ends early."""
    end = object()
    for a, b in itertools.zip_longest(read_lines(src), read_lines(tgt), fillvalue=end):
        if a is end or b is end:
            raise DataError(f"{src} and {tgt} changed length while being read; rerun the stage")
        yield normalize(a), normalize(b)  # type: ignore[arg-type]


def _rule(cfg: CleanConfig, src: str, tgt: str) -> str | None:
    """The first rule (before dedup) that drops this normalised pair, or None."""
    if not src or not tgt:
        return "empty"
    ns, nt = _n_words(src), _n_words(tgt)
    if min(ns, nt) < cfg.min_words:
        return "too_short"
    if max(ns, nt) > cfg.max_words:
        return "too_long"
    if max(ns, nt) > cfg.max_ratio * min(ns, nt):
        return "ratio"
    if cfg.drop_copies and src == tgt:
        return "copy"
    return None


def _filter_batch(cfg: CleanConfig, batch: list[tuple[str, str]], seen: DigestSet | None,
                  dropped: dict[str, int]) -> list[tuple[str, str]]:
    """Apply every rule to one batch of pairs (in order); update ``dropped``."""
    kept = []
    for pair in batch:
        rule = _rule(cfg, *pair)
        if rule is None:
            kept.append(pair)
        else:
            dropped[rule] += 1
    if seen is None:
        return kept
    fresh = seen.add_batch([pair_digest(s, t) for s, t in kept])
    dropped["duplicate"] += int(len(kept) - fresh.sum())
    return [pair for pair, ok in zip(kept, fresh) if ok]


def clean_split(cfg: CleanConfig, split: str, raw_dir: Path, out_dir: Path) -> dict:
    """Normalise (and for train, filter) one split into ``out_dir``; return its counts."""
    src, tgt, total = _raw_files(raw_dir, split)
    filtering = split == "train"
    seen = DigestSet() if filtering and cfg.dedup else None
    dropped = dict.fromkeys(RULES, 0)
    n_in = n_out = blank = 0
    start = last_log = time.monotonic()
    pairs = _pairs(src, tgt)
    with open(out_dir / f"{split}.en", "w", encoding="utf-8", newline="\n") as f_src, \
            open(out_dir / f"{split}.de", "w", encoding="utf-8", newline="\n") as f_tgt:
        while batch := list(itertools.islice(pairs, _BATCH)):
            n_in += len(batch)
            if filtering:
                batch = _filter_batch(cfg, batch, seen, dropped)
            else:
                blank += sum(1 for a, b in batch if not a or not b)
            n_out += len(batch)
            f_src.write("".join(s + "\n" for s, _ in batch))
            f_tgt.write("".join(t + "\n" for _, t in batch))
            if time.monotonic() - last_log > _LOG_EVERY_S:
                last_log = time.monotonic()
                rate = n_in / (last_log - start)
                log.info("clean %s: %d/%d pairs read, %d kept, %.0f pairs/s, ETA %.0f s", split, n_in, total,
                         n_out, rate, (total - n_in) / max(rate, 1e-9))
    counts: dict = {"pairs_in": n_in, "pairs_out": n_out}
    if filtering:
        counts["dropped"] = dropped
    else:
        _check_blank(split, src, tgt, n_in, blank)
        counts["blank"] = blank
    log.info("clean %s: %d pairs in, %d out%s", split, n_in, n_out,
             f", dropped {dropped}" if filtering else "")
    return counts


def _check_blank(split: str, src: Path, tgt: Path, pairs: int, blank: int) -> None:
    """Refuse a valid/test set with no complete pair; warn about blank lines (kept, to keep line numbers)."""
    if blank == pairs:
        raise DataError(f"{src} and {tgt}: all {pairs} pairs are blank on one side or both after normalisation: "
                        f"nothing to score on the {split} set; check or rerun the download stage (`dvc repro download`)")
    if blank:
        log.warning("clean %s: %d of %d pairs are blank on one side (kept: valid/test keep every line)", split, blank,
                    pairs)


def _check_not_empty(cfg: CleanConfig, counts: dict) -> None:
    if counts["pairs_out"]:
        return
    rules = ", ".join(f"{k}={v}" for k, v in counts["dropped"].items() if v)
    raise DataError(
        f"clean: every one of the {counts['pairs_in']} training pairs was dropped ({rules}); loosen "
        f"clean.min_words={cfg.min_words}, clean.max_words={cfg.max_words}, clean.max_ratio={cfg.max_ratio}, "
        f"clean.drop_copies={cfg.drop_copies} or clean.dedup={cfg.dedup} in params.yaml")


def stage(cfg: CleanConfig, *, raw_dir: str | Path, clean_dir: str | Path) -> dict:
    """Run the clean stage: ``raw_dir`` → ``clean_dir`` (atomically).

    Returns:
        Per split ``pairs_in`` and ``pairs_out``, and for train the pairs ``dropped`` per rule.

    Raises:
        DataError: a missing, empty or misaligned raw file, invalid UTF-8 or a NUL byte (file:line),
            or a training set emptied by the filters (naming the counts per rule and the params to loosen).
        OutputError: the disk filled up while writing (the previous ``clean_dir`` is kept).
    """
    from pipeline.core import tracking

    raw_dir, clean_dir = Path(raw_dir), Path(clean_dir)
    for split in SPLITS:  # fail before writing anything
        _raw_files(raw_dir, split)
    metrics: dict = {}
    with atomic_path(clean_dir) as tmp:
        tmp.mkdir()
        for split in SPLITS:
            metrics[split] = clean_split(cfg, split, raw_dir, tmp)
            if split == "train":
                _check_not_empty(cfg, metrics[split])
    tracking.current().log_metrics(
        {f"{s}.{k}": v for s in SPLITS for k, v in metrics[s].items() if k != "dropped"}
        | {f"train.dropped.{k}": v for k, v in metrics["train"]["dropped"].items()})
    return metrics


def _run(params: Params, args: argparse.Namespace) -> dict:
    return stage(params.clean, raw_dir=params.paths.raw, clean_dir=params.paths.clean)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.clean [--params params.yaml]``."""
    return stage_main("clean", _run, argv)


if __name__ == "__main__":
    sys.exit(main())

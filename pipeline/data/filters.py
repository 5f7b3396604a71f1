"""The clean stage's work: every line normalised, training pairs filtered (:data:`RULES`), in blocks in worker
processes; dedup (one 16-byte digest per pair, never the text) and writing stay in line order in the caller's
process, so the bytes do not depend on the workers."""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.config import CleanConfig
from pipeline.core.data_details import PairCounts
from pipeline.core.errors import DataError
from pipeline.core.textio import line_offsets, read_line_block
from pipeline.data.normalize import normalize
from pipeline.data.workers import process_pool

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")  # as in pipeline.data.sources, not imported: its tables are no dep of clean
LANGS = ("en", "de")
RULES = ("empty", "too_short", "too_long", "ratio", "copy", "duplicate")
BLOCK_ROWS = 65536  # pairs per block: one task of a worker, ~10-20 MB of text
_LOG_EVERY_S = 10.0


def pair_digest(src: str, tgt: str) -> bytes:
    """16-byte digest of a normalised pair (``\\n`` cannot occur inside a line: unambiguous)."""
    return hashlib.blake2b(f"{src}\n{tgt}".encode(), digest_size=16).digest()


class DigestSet:
    """A set of 16-byte digests in a vectorised open-addressing numpy table (~34 bytes an entry, a ``set`` ~100)."""

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

    def add_batch(self, digests: list[bytes] | bytes) -> np.ndarray:
        """Add digests in order (a list, or joined); return a mask, True where a digest is seen the first time."""
        if not digests:
            return np.zeros(0, dtype=bool)
        joined = digests if isinstance(digests, bytes) else b"".join(digests)
        keys = np.frombuffer(joined, dtype=np.uint64).reshape(-1, 2)
        _, first = np.unique(keys.view(np.dtype((np.void, 16))).ravel(), return_index=True)
        first.sort()
        while (self._n + len(first)) * 2 > len(self._used):
            self._grow()
        result = np.zeros(len(keys), dtype=bool)
        result[first] = self._insert_unique(keys[first])
        return result


def _n_words(line: str) -> int:
    """Words of a normalised line (single spaces, no leading/trailing space)."""
    return line.count(" ") + 1 if line else 0


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
    return "copy" if cfg.drop_copies and src == tgt else None


@dataclass(frozen=True)
class Block:
    """Lines ``[first_line, first_line + count)`` of a split: their byte ranges in both raw files."""

    src: str
    tgt: str
    src_range: tuple[int, int]  # [start, end) in bytes; end -1 = to the end of the file
    tgt_range: tuple[int, int]
    first_line: int
    count: int
    cfg: CleanConfig | None  # None: normalise only (valid/test)


@dataclass
class BlockResult:
    """A block after normalisation and the per-pair rules: kept text, one digest per kept pair, counts."""

    src_text: str  # kept lines, each followed by "\n"
    tgt_text: str
    digests: bytes  # 16 bytes per kept pair (train with dedup only)
    kept: int
    dropped: dict[str, int]
    blank: int


def plan_blocks(src: Path, tgt: Path, cfg: CleanConfig | None) -> tuple[list[Block], int]:
    """Cut a split (aligned files: the stage checked) into blocks of :data:`BLOCK_ROWS` lines, and its line count."""
    rows = BLOCK_ROWS
    (src_offs, n_src), (tgt_offs, _) = (line_offsets(p, rows) for p in (src, tgt))
    src_ends, tgt_ends = src_offs[1:] + [-1], tgt_offs[1:] + [-1]
    blocks = [Block(str(src), str(tgt), (s0, s1), (t0, t1), k * rows, min(rows, n_src - k * rows), cfg)
              for k, (s0, s1, t0, t1) in enumerate(zip(src_offs, src_ends, tgt_offs, tgt_ends))
              if k * rows < n_src]
    return blocks, n_src


def clean_block(block: Block) -> BlockResult:
    """Normalise one block and, for training text, apply every rule but dedup (which needs the order)."""
    src = read_line_block(block.src, *block.src_range, block.first_line)
    tgt = read_line_block(block.tgt, *block.tgt_range, block.first_line)
    if len(src) != block.count or len(tgt) != block.count:
        raise DataError(f"{block.src} and {block.tgt} changed length while being read; rerun the stage")
    pairs = [(normalize(a), normalize(b)) for a, b in zip(src, tgt)]
    dropped = dict.fromkeys(RULES, 0)
    if (cfg := block.cfg) is None:
        blank = sum(1 for a, b in pairs if not a or not b)
        return BlockResult(_text(p[0] for p in pairs), _text(p[1] for p in pairs), b"", len(pairs), dropped, blank)
    kept = []
    for pair in pairs:
        if (rule := _rule(cfg, *pair)) is None:
            kept.append(pair)
        else:
            dropped[rule] += 1
    digests = b"".join(pair_digest(s, t) for s, t in kept) if cfg.dedup else b""
    return BlockResult(_text(p[0] for p in kept), _text(p[1] for p in kept), digests, len(kept), dropped, 0)


def _text(lines: Iterable[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _drop_repeats(result: BlockResult, fresh: np.ndarray) -> tuple[str, str]:
    """The block's text without the pairs ``fresh`` marks False (seen before)."""
    if fresh.all():
        return result.src_text, result.tgt_text
    keep = fresh.tolist()
    src, tgt = (_text(line for line, ok in zip(text.split("\n"), keep) if ok)
                for text in (result.src_text, result.tgt_text))
    return src, tgt


def clean_split(cfg: CleanConfig, split: str, raw_dir: Path, out_dir: Path, workers: int = 1) -> PairCounts:
    """Normalise (and for train, filter) one split of ``raw_dir`` into ``out_dir``.

    Returns:
        ``pairs_in`` and ``pairs_out``; for train the pairs ``dropped`` per rule, else the ``blank`` pairs kept.

    Raises:
        DataError: invalid UTF-8 or a NUL byte (file:line), an all-blank valid/test set, or a training set the
            filters emptied (naming the counts per rule and the params to loosen).
    """
    src, tgt = (raw_dir / f"{split}.{lang}" for lang in LANGS)
    filtering = split == "train"
    blocks, total = plan_blocks(src, tgt, cfg if filtering else None)
    seen = DigestSet() if filtering and cfg.dedup else None
    dropped = dict.fromkeys(RULES, 0)
    n_in = n_out = blank = 0
    start = last_log = time.monotonic()
    with open(out_dir / f"{split}.en", "w", encoding="utf-8", newline="\n") as f_src, \
            open(out_dir / f"{split}.de", "w", encoding="utf-8", newline="\n") as f_tgt:
        for block, result in zip(blocks, run_blocks(blocks, workers)):
            n_in += block.count
            blank += result.blank
            dropped = {k: dropped[k] + result.dropped[k] for k in RULES}
            src_text, tgt_text, kept = result.src_text, result.tgt_text, result.kept
            if seen is not None:
                fresh = seen.add_batch(result.digests)
                kept = int(fresh.sum())
                dropped["duplicate"] += len(fresh) - kept
                src_text, tgt_text = _drop_repeats(result, fresh)
            n_out += kept
            f_src.write(src_text)
            f_tgt.write(tgt_text)
            if time.monotonic() - last_log > _LOG_EVERY_S:
                last_log = time.monotonic()
                rate = n_in / (last_log - start)
                log.info("clean %s: %d/%d pairs read, %d kept, %.0f pairs/s, ETA %.0f s", split, n_in, total,
                         n_out, rate, (total - n_in) / max(rate, 1e-9))
    log.info("clean %s: %d pairs in, %d out%s", split, n_in, n_out, f", dropped {dropped}" if filtering else "")
    if not filtering:
        _check_blank(split, src, tgt, n_in, blank)
        return PairCounts(pairs_in=n_in, pairs_out=n_out, blank=blank)
    counts = PairCounts(pairs_in=n_in, pairs_out=n_out, dropped=dropped)
    _check_not_empty(cfg, counts)
    return counts


def run_blocks(blocks: list[Block], workers: int) -> Iterator[BlockResult]:
    """:func:`clean_block` of every block, in order; at most ``2 * workers`` blocks in flight."""
    if workers <= 1 or len(blocks) <= 1:
        yield from map(clean_block, blocks)
        return
    with process_pool(min(workers, len(blocks)), (__name__,)) as pool:
        todo = iter(blocks)
        window = collections.deque(pool.submit(clean_block, b) for b in itertools.islice(todo, 2 * workers))
        while window:
            result = window.popleft().result()
            if (block := next(todo, None)) is not None:
                window.append(pool.submit(clean_block, block))
            yield result


def _check_blank(split: str, src: Path, tgt: Path, pairs: int, blank: int) -> None:
    """Refuse a valid/test set with no complete pair; warn about blank lines (kept)."""
    if blank == pairs:
        raise DataError(f"{src} and {tgt}: all {pairs} pairs are blank on one side or both after normalisation: "
                        f"nothing to score on the {split} set; check or rerun the download stage "
                        "(`dvc repro download`)")
    if blank:
        log.warning("clean %s: %d of %d pairs are blank on one side (kept: valid/test keep every line)", split, blank,
                    pairs)


def _check_not_empty(cfg: CleanConfig, counts: PairCounts) -> None:
    if counts.pairs_out:
        return
    rules = ", ".join(f"{k}={v}" for k, v in (counts.dropped or {}).items() if v)
    raise DataError(
        f"clean: every one of the {counts.pairs_in} training pairs was dropped ({rules}); loosen "
        f"clean.min_words={cfg.min_words}, clean.max_words={cfg.max_words}, clean.max_ratio={cfg.max_ratio}, "
        f"clean.drop_copies={cfg.drop_copies} or clean.dedup={cfg.dedup} in params.yaml")

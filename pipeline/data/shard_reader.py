"""Reading the encode stage's Parquet shards: the shard of an id is found by binary search in the manifest's
line ranges, and its tokens are decoded on first use into flat numpy arrays."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import DataError
from pipeline.core.textio import sha256_file

_REMEDY = "rerun `dvc repro encode`"
_COLUMNS = ("id", "src", "tgt", "src_len", "tgt_len")


def read_manifest(shards_dir: str | Path) -> dict:
    """Parse ``<shards_dir>/manifest.json``; a DataError when it is missing, not JSON or lacks the keys read."""
    path = Path(shards_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path}: missing; run `dvc repro encode` first") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc}); {_REMEDY}") from None
    missing = [k for k in ("spm_sha256", "vocab_size", "splits") if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise DataError(f"{path}: not a shards manifest (missing {missing}); {_REMEDY}")
    return manifest


def _check_types(table: pa.Table, path: Path) -> None:
    for name in table.column_names:
        kind = table.schema.field(name).type
        ok = (pa.types.is_integer(kind) if name in ("id", "src_len", "tgt_len")
              else pa.types.is_list(kind) and pa.types.is_unsigned_integer(kind.value_type))
        if not ok:
            raise DataError(f"{path}: column {name!r} is {kind}, not what the encode stage writes; {_REMEDY}")


@dataclass(frozen=True)
class _Shard:
    """One decoded shard: ids [n] int64, flat tokens and offsets [n + 1] per side."""

    ids: np.ndarray
    src: np.ndarray
    src_off: np.ndarray
    tgt: np.ndarray
    tgt_off: np.ndarray

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return (self.src[self.src_off[i]:self.src_off[i + 1]], self.tgt[self.tgt_off[i]:self.tgt_off[i + 1]])


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets [n + 1] int64) of a list column."""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    return values, offsets - offsets[0]


class ShardSet:
    """The shards of one split of the encode stage's folder ``shards_dir`` (a DataError for a bad manifest or split)."""

    def __init__(self, shards_dir: str | Path, split: str) -> None:
        self.root = Path(shards_dir)
        self.split = split
        self.manifest = read_manifest(self.root)
        if split not in self.manifest["splits"]:
            raise DataError(f"{self.root / 'manifest.json'}: no split {split!r} "
                            f"(has {sorted(self.manifest['splits'])}); {_REMEDY}")
        self._info = self.manifest["splits"][split]
        self._shards = self._info["shards"]
        self._starts = np.array([s["line_start"] for s in self._shards], dtype=np.int64)
        self._ends = np.array([s["line_end"] for s in self._shards], dtype=np.int64)
        self._cache: dict[int, _Shard] = {}
        self._lengths: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self._info["rows"])

    @property
    def vocab_size(self) -> int:
        """Size of the BPE vocabulary the shards were encoded with."""
        return int(self.manifest["vocab_size"])

    def _path(self, k: int) -> Path:
        return self.root / self._shards[k]["path"]

    def _read(self, k: int, columns: Sequence[str]) -> pa.Table:
        path = self._path(k)
        try:  # one file: ParquetFile, not pq.read_table, which builds a pyarrow dataset on every call
            with pq.ParquetFile(path) as shard:
                table = shard.read(columns=list(columns))
        except FileNotFoundError:
            raise DataError(f"{path}: missing shard listed in {self.root / 'manifest.json'}; {_REMEDY}") from None
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{path}: corrupt Parquet shard ({exc}); {_REMEDY}") from None
        if missing := [c for c in columns if c not in table.column_names]:
            raise DataError(f"{path}: no column {missing[0]!r}, which the encode stage writes; {_REMEDY}")
        if table.num_rows != self._shards[k]["rows"]:
            raise DataError(f"{path}: {table.num_rows} rows, the manifest says {self._shards[k]['rows']}; {_REMEDY}")
        _check_types(table, path)
        return table

    def _decode(self, k: int) -> _Shard:
        table = self._read(k, _COLUMNS)
        src, src_off = _flat(table.column("src"))
        tgt, tgt_off = _flat(table.column("tgt"))
        for side, tokens in (("src", src), ("tgt", tgt)):
            if tokens.size and int(tokens.max()) >= self.vocab_size:
                raise DataError(f"{self._path(k)}: column {side!r} holds token id {int(tokens.max())}, beyond the "
                                f"vocabulary of {self.vocab_size} in {self.root / 'manifest.json'}; {_REMEDY}")
        return _Shard(table.column("id").to_numpy(), src, src_off, tgt, tgt_off)

    def _shard(self, k: int) -> _Shard:
        if k not in self._cache:
            self._cache[k] = self._decode(k)
        return self._cache[k]

    def lengths(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids [n] int64, src_len [n] int32, tgt_len [n] int32) of every row, in id order (no EOS)."""
        if self._lengths is None:
            parts = [self._read(k, ("id", "src_len", "tgt_len")) for k in range(len(self._shards))]
            cols = [[p.column(c).to_numpy() for p in parts] for c in ("id", "src_len", "tgt_len")]
            dtypes = (np.int64, np.int32, np.int32)
            self._lengths = tuple(np.concatenate(c).astype(d, copy=False) if c else np.zeros(0, d)
                                  for c, d in zip(cols, dtypes))  # type: ignore[assignment]
        return self._lengths  # type: ignore[return-value]

    def fetch(self, ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Token arrays (src, tgt) of the rows ``ids``, in order (no BOS/EOS); a KeyError for an id not in the split."""
        want = np.asarray(ids, dtype=np.int64)
        which = np.searchsorted(self._ends, want, side="right")
        out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(want)
        for k in np.unique(which):
            sel = np.flatnonzero(which == k)
            if k >= len(self._shards) or (want[sel] < self._starts[k]).any():
                raise KeyError(f"ids {want[sel][:5].tolist()} are not in split {self.split!r}")
            shard = self._shard(int(k))
            pos = np.minimum(np.searchsorted(shard.ids, want[sel]), max(len(shard.ids) - 1, 0))
            bad = shard.ids[pos] != want[sel] if len(shard.ids) else np.ones(len(sel), dtype=bool)
            if bad.any():
                raise KeyError(f"ids {want[sel][bad][:5].tolist()} are not in split {self.split!r} "
                               "(dropped by encode.max_len?)")
            for i, p in zip(sel.tolist(), pos.tolist()):
                out[i] = shard.row(p)
        return out  # type: ignore[return-value]

    def iter_rows(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Stream (id, src, tgt) over every row in id order, one decoded shard in memory at a time."""
        for k in range(len(self._shards)):
            shard = self._cache.get(k) or self._decode(k)
            for i, row_id in enumerate(shard.ids.tolist()):
                yield (row_id, *shard.row(i))

    def check_spm(self, spm_model: str | Path) -> None:
        """Refuse shards encoded with another BPE model (a DataError naming both sha256 values)."""
        actual = sha256_file(spm_model)
        expected = self.manifest["spm_sha256"]
        if actual != expected:
            raise DataError(f"{self.root / 'manifest.json'} was encoded with spm.model sha256 {expected}, but "
                            f"{spm_model} has sha256 {actual}; {_REMEDY} (or `dvc repro` to rebuild both)")

    def verify(self) -> None:
        """Check each shard file against its manifest sha256 (a second per GB); a DataError names the first bad one."""
        manifest = self.root / "manifest.json"
        problems = []
        for k, entry in enumerate(self._shards):
            path = self._path(k)
            recorded = entry.get("sha256") if isinstance(entry, dict) else None
            if not isinstance(recorded, str):
                problems.append(f"{path}: no sha256 recorded in {manifest}, so it cannot be checked")
            elif not path.is_file():
                problems.append(f"{path}: missing shard listed in {manifest}")
            elif sha256_file(path) != recorded:
                problems.append(f"{path}: content does not match the sha256 in {manifest} (rewritten or damaged "
                                "after encode)")
        if problems:
            more = f" (and {len(problems) - 1} other shard(s) of split {self.split!r})" if len(problems) > 1 else ""
            raise DataError(f"{problems[0]}{more}; {_REMEDY}")

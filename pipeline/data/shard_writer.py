"""Writing the encode stage's Parquet shards: shard ``k`` of a split holds lines ``[k, k + 1) * shard_rows``
(training pairs over ``encode.max_len`` dropped), byte-identical on rerun (:data:`WRITE_OPTIONS`)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.config import EncodeConfig
from pipeline.core.errors import DataError
from pipeline.core.owned import atomic_path
from pipeline.core.textio import line_offsets, read_line_block, sha256_file
from pipeline.data.workers import process_pool

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
MANIFEST_FORMAT = 1
# Fixed writer options: together with the pinned pyarrow they make shards byte-identical on rerun.
WRITE_OPTIONS = {"compression": "zstd", "compression_level": 3, "use_dictionary": False,
                 "write_statistics": False, "version": "2.6", "data_page_version": "1.0", "store_schema": True}


def token_type(vocab_size: int) -> pa.DataType:
    """uint16 while every id fits, else uint32."""
    return pa.uint16() if vocab_size <= 1 << 16 else pa.uint32()


def shard_schema(vocab_size: int) -> pa.Schema:
    """``id`` (the line in the clean file), ``src``/``tgt`` token lists without BOS/EOS, and their lengths."""
    tok = pa.list_(token_type(vocab_size))
    return pa.schema([("id", pa.int64()), ("src", tok), ("tgt", tok), ("src_len", pa.int32()), ("tgt_len", pa.int32())])


@dataclass(frozen=True)
class ShardTask:
    """One shard to encode: lines ``[line_start, line_end)`` of a split, at byte ranges of its two files."""

    split: str
    index: int
    line_start: int
    line_end: int
    files: tuple[tuple[str, int, int], ...]  # (path, start, end) of the EN and DE lines; end -1: end of file
    spm_model: str
    spm_sha256: str
    max_len: int | None  # None: keep every line (valid/test)
    out_dir: str
    threads: int

    @property
    def rel_path(self) -> str:
        return f"{self.split}/part-{self.index:05d}.parquet"


def _read_block(task: ShardTask, path: str, start: int, end: int) -> list[str]:
    lines = read_line_block(path, start, end, task.line_start)
    if len(lines) != task.line_end - task.line_start:
        raise DataError(f"{path}: expected {task.line_end - task.line_start} lines from line {task.line_start + 1}, "
                        f"found {len(lines)}; the file changed during encoding, rerun `dvc repro encode`")
    return lines


@functools.lru_cache(maxsize=4)
def processor(model_file: str, sha256: str):  # sentencepiece is imported lazily: no return annotation
    """A loaded model, cached per process; keyed by content so a rewritten file is reloaded."""
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=model_file)


def encode_lines(sp, lines: list[str], threads: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Batch-encode ``lines``; return (flat ids [total] ``dtype``, lengths [len(lines)] int64)."""
    ids = sp.encode(lines, num_threads=threads)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


def _list_array(flat: np.ndarray, lengths: np.ndarray, keep: np.ndarray) -> pa.ListArray:
    """An Arrow list array of the rows of (flat, lengths) selected by ``keep``."""
    flat, lengths = flat[np.repeat(keep, lengths)], lengths[keep]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def encode_shard(task: ShardTask) -> dict:
    """Encode one shard and write it atomically; return its manifest entry (+ ``dropped``)."""
    sp = processor(task.spm_model, task.spm_sha256)
    vocab = sp.get_piece_size()
    dtype = np.dtype(token_type(vocab).to_pandas_dtype())
    (src, src_len), (tgt, tgt_len) = (encode_lines(sp, _read_block(task, *file), task.threads, dtype)
                                      for file in task.files)
    keep = np.ones(len(src_len), dtype=bool)
    if task.max_len is not None:
        keep = (src_len <= task.max_len) & (tgt_len <= task.max_len)
    ids = np.arange(task.line_start, task.line_end, dtype=np.int64)[keep]
    table = pa.table([pa.array(ids), _list_array(src, src_len, keep), _list_array(tgt, tgt_len, keep),
                      pa.array(src_len[keep].astype(np.int32)), pa.array(tgt_len[keep].astype(np.int32))],
                     schema=shard_schema(vocab))
    out_path = Path(task.out_dir) / task.rel_path
    with atomic_path(out_path) as tmp:
        pq.write_table(table, tmp, row_group_size=max(1, len(ids)), **WRITE_OPTIONS)
    return {"path": task.rel_path, "rows": len(ids), "line_start": task.line_start, "line_end": task.line_end,
            "src_tokens": int(src_len[keep].sum()), "tgt_tokens": int(tgt_len[keep].sum()),
            "sha256": sha256_file(out_path), "dropped": len(keep) - len(ids)}


def plan_tasks(cfg: EncodeConfig, clean_dir: Path, spm_model: Path, spm_sha256: str, out_dir: Path,
               workers: int) -> tuple[list[ShardTask], dict[str, int]]:
    """Cut every split into shard tasks; return them and each split's line count."""
    specs, lines = [], {}
    for split in SPLITS:
        src, tgt = clean_dir / f"{split}.en", clean_dir / f"{split}.de"
        for path in (src, tgt):
            if not path.is_file():
                raise DataError(f"{path}: missing; run `dvc repro clean` first")
        (src_offs, n_src), (tgt_offs, n_tgt) = (line_offsets(p, cfg.shard_rows) for p in (src, tgt))
        if n_src != n_tgt:
            raise DataError(f"{src} has {n_src} lines but {tgt} has {n_tgt}: not aligned; rerun `dvc repro clean`")
        if n_src == 0:
            raise DataError(f"{src} and {tgt} are empty: every split needs text; rerun `dvc repro clean`")
        lines[split] = n_src
        ranges = [[(str(path), s, e) for s, e in zip(offs, offs[1:] + [-1])] for path, offs in
                  ((src, src_offs), (tgt, tgt_offs))]
        specs += [(split, k, files, n_src) for k, files in enumerate(zip(*ranges)) if n_src > k * cfg.shard_rows]
    threads = max(1, (os.cpu_count() or 1) // max(1, min(workers, len(specs))))
    tasks = [ShardTask(split=split, index=k, line_start=k * cfg.shard_rows, line_end=min(n, (k + 1) * cfg.shard_rows),
                       files=files, spm_model=str(spm_model), spm_sha256=spm_sha256,
                       max_len=cfg.max_len if split == "train" else None, out_dir=str(out_dir), threads=threads)
             for split, k, files, n in specs]
    return tasks, lines


def run_tasks(tasks: list[ShardTask], workers: int) -> list[dict]:
    """Run the tasks (in a process pool when it helps), logging progress; results in task order."""
    results: list[dict | None] = [None] * len(tasks)
    total = sum(t.line_end - t.line_start for t in tasks)
    done_lines, start = 0, time.monotonic()
    with contextlib.ExitStack() as stack:
        if workers == 1 or len(tasks) <= 1:
            finished = ((i, encode_shard(task)) for i, task in enumerate(tasks))
        else:  # the forkserver imports this module, never the stage module (its workers would re-run that)
            pool = stack.enter_context(process_pool(min(workers, len(tasks)), (__name__, "sentencepiece")))
            futures = {pool.submit(encode_shard, t): i for i, t in enumerate(tasks)}
            finished = ((futures[fut], fut.result()) for fut in cf.as_completed(futures))
        for i, result in finished:
            results[i] = result
            done_lines += tasks[i].line_end - tasks[i].line_start
            rate = done_lines / max(time.monotonic() - start, 1e-9)
            log.info("encode: %d/%d shards, %d/%d pairs, %.0f pairs/s, ETA %.0f s",
                     sum(r is not None for r in results), len(tasks), done_lines, total, rate,
                     (total - done_lines) / max(rate, 1e-9))
    return results  # type: ignore[return-value]


def build_manifest(tasks: list[ShardTask], results: list[dict], lines: dict[str, int], *, vocab_size: int,
                   spm_sha256: str, cfg: EncodeConfig) -> dict:
    """The manifest: every shard (path relative to it, rows, token counts, sha256) per split."""
    splits: dict[str, dict] = {}
    for split in SPLITS:
        shards = [{k: v for k, v in r.items() if k != "dropped"} for t, r in zip(tasks, results) if t.split == split]
        splits[split] = {"lines": lines[split], "rows": sum(s["rows"] for s in shards),
                         "dropped_max_len": sum(r["dropped"] for t, r in zip(tasks, results) if t.split == split),
                         "src_tokens": sum(s["src_tokens"] for s in shards),
                         "tgt_tokens": sum(s["tgt_tokens"] for s in shards), "shards": shards}
    return {"format": MANIFEST_FORMAT, "spm_sha256": spm_sha256, "vocab_size": vocab_size,
            "token_type": str(token_type(vocab_size)), "max_len": cfg.max_len, "shard_rows": cfg.shard_rows,
            "splits": splits}

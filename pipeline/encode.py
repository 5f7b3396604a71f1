"""Stage ``encode``: cleaned text → BPE ids in Parquet shards plus ``manifest.json``, written by
:mod:`pipeline.data.shard_writer` in ``NMT_DATA_WORKERS`` processes and read by :mod:`pipeline.data.shard_reader`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from pipeline import tracking
from pipeline.core.config import EncodeConfig
from pipeline.core.data_details import EncodeDetails, SplitCounts
from pipeline.core.errors import DataError
from pipeline.core.owned import atomic_path, write_text
from pipeline.core.textio import sha256_file
from pipeline.data.shard_writer import SPLITS, build_manifest, plan_tasks, processor, run_tasks
from pipeline.data.workers import data_workers
from pipeline.tracking.harness import stage_main

log = logging.getLogger(__name__)


def stage(cfg: EncodeConfig, *, clean_dir: str | Path, bpe_dir: str | Path,
          shards_dir: str | Path) -> EncodeDetails:
    """Run the encode stage: clean text + ``spm.model`` → ``shards_dir`` (atomically); return per split the manifest's
    rows and token counts, and the workers, vocabulary size and pairs/s. A bad input is a DataError."""
    clean_dir, shards_dir = Path(clean_dir), Path(shards_dir)
    spm_model = Path(bpe_dir) / "spm.model"
    if not spm_model.is_file():
        raise DataError(f"{spm_model}: missing; run `dvc repro bpe` first")
    spm_sha256 = sha256_file(spm_model)
    try:
        vocab_size = processor(str(spm_model.resolve()), spm_sha256).get_piece_size()
    except (OSError, RuntimeError) as exc:
        raise DataError(f"{spm_model}: not a SentencePiece model ({exc}); rerun `dvc repro bpe`") from None
    workers = data_workers()
    start = time.monotonic()
    with atomic_path(shards_dir, role="shards") as tmp:
        tmp.mkdir()  # each shard's folder is made as it is written
        tasks, lines = plan_tasks(cfg, clean_dir, spm_model.resolve(), spm_sha256, tmp, workers)
        results = run_tasks(tasks, workers)
        manifest = build_manifest(tasks, results, lines, vocab_size=vocab_size, spm_sha256=spm_sha256, cfg=cfg)
        write_text(tmp / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    seconds = time.monotonic() - start
    counts = {split: SplitCounts(lines=totals["lines"], rows=totals["rows"], dropped_max_len=totals["dropped_max_len"],
                                 src_tokens=totals["src_tokens"], tgt_tokens=totals["tgt_tokens"])
              for split, totals in ((s, manifest["splits"][s]) for s in SPLITS)}
    tracking.current().log_metrics({f"{s}.{k}": v for s in SPLITS for k, v in counts[s].model_dump().items()})
    log.info("encode: %s", {s: counts[s].rows for s in SPLITS})
    return EncodeDetails(train=counts["train"], valid=counts["valid"], test=counts["test"], workers=workers,
                         vocab_size=vocab_size, pairs_per_s=round(sum(lines.values()) / max(seconds, 1e-9), 1))


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.encode [--params params.yaml]``."""
    return stage_main("encode", lambda params, _: stage(params.encode, clean_dir=params.paths.clean,
                                                        bpe_dir=params.paths.bpe, shards_dir=params.paths.shards), argv)


if __name__ == "__main__":
    sys.exit(main())

"""Stage ``clean``: ``<raw>/{train,valid,test}.{en,de}`` normalised into ``<clean>/``, training pairs filtered
(:mod:`pipeline.data.filters`), in ``NMT_DATA_WORKERS`` processes whose number does not change the bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline import tracking
from pipeline.core.config import CleanConfig
from pipeline.core.data_details import CleanDetails
from pipeline.core.errors import DataError
from pipeline.core.owned import atomic_path
from pipeline.core.textio import count_lines
from pipeline.data.filters import LANGS, SPLITS, clean_split
from pipeline.data.workers import data_workers
from pipeline.tracking.harness import stage_main


def _check_raw(raw_dir: Path, split: str) -> None:
    """Refuse a missing, misaligned or empty raw file of ``split``."""
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


def stage(cfg: CleanConfig, *, raw_dir: str | Path, clean_dir: str | Path) -> CleanDetails:
    """Run the clean stage: ``raw_dir`` → ``clean_dir`` (atomically); per split the counts of
    :func:`pipeline.data.filters.clean_split`, whose DataErrors it raises, or one for a bad raw file."""
    raw_dir, clean_dir = Path(raw_dir), Path(clean_dir)
    for split in SPLITS:  # fail before writing anything
        _check_raw(raw_dir, split)
    workers = data_workers()
    with atomic_path(clean_dir, role="clean") as tmp:
        tmp.mkdir()
        counts = {split: clean_split(cfg, split, raw_dir, tmp, workers) for split in SPLITS}
    tracking.current().log_metrics(
        {f"{s}.{k}": v for s in SPLITS for k, v in counts[s].model_dump(exclude={"dropped"}).items() if v is not None}
        | {f"train.dropped.{k}": v for k, v in (counts["train"].dropped or {}).items()})
    return CleanDetails(train=counts["train"], valid=counts["valid"], test=counts["test"])


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.clean [--params params.yaml]``."""
    return stage_main("clean", lambda params, _: stage(params.clean, raw_dir=params.paths.raw,
                                                       clean_dir=params.paths.clean), argv)


if __name__ == "__main__":
    sys.exit(main())

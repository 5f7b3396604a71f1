"""Stage ``average``: the mean of the last N complete checkpoints (:mod:`pipeline.artifacts.averaging`), as one
self-contained ``averaged.pt`` with the newest checkpoint's config and the ``spm.model`` bytes
(:mod:`pipeline.artifacts.model_file`).
"""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

from pipeline.artifacts import averaging, model_file
from pipeline.core.config import AverageConfig, checkpoint_folder
from pipeline.core.details import AverageDetails
from pipeline.core.errors import CheckpointError
from pipeline.core.owned import atomic_path, refuse_foreign
from pipeline.tracking.harness import stage_main

log = logging.getLogger(__name__)


def stage(cfg: AverageConfig, *, train_dir: str | Path, bpe_dir: str | Path,
          model_dir: str | Path) -> AverageDetails:
    """Average the last ``cfg.last_n`` complete checkpoints of ``train_dir`` into ``model_dir/averaged.pt``
    (``model_dir`` is written whole, replacing only a folder this stage wrote); returns the stage's record."""
    import sentencepiece as spm

    from pipeline import tracking

    refuse_foreign(Path(model_dir), "model")  # before the work, not only at the swap
    chosen, skipped = averaging.choose(train_dir, cfg.last_n)
    spm_path = Path(bpe_dir) / "spm.model"
    try:
        spm_bytes = spm_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{spm_path}: not found; run the bpe stage first") from None
    vocab_size = spm.SentencePieceProcessor(model_proto=spm_bytes).get_piece_size()
    config = model_file.checkpoint_config(chosen[-1], vocab_size)
    weights = averaging.average_state_dicts(chosen)
    averaging.check_fits(config, weights, chosen[-1] / "model.pt")
    out = model_file.path_in(model_dir)
    with atomic_path(model_dir, role="model") as tmp:  # the folder whole: replaced only if this stage wrote it
        tmp.mkdir()
        model_file.save(model_file.path_in(tmp), weights=weights, config=config, spm=spm_bytes)
    record = AverageDetails(
        checkpoints=[p.name for p in chosen], steps=[int(p.name.split("-")[1]) for p in chosen],
        requested=cfg.last_n, used=len(chosen), fewer_than_requested=len(chosen) < cfg.last_n,
        skipped_incomplete=[p.name for p in skipped], spm_sha256=hashlib.sha256(spm_bytes).hexdigest(),
        parameters=int(sum(v.numel() for v in weights.values() if v.is_floating_point())))
    run = tracking.current()
    run.log_params({"average.checkpoints": ",".join(record.checkpoints)})
    run.log_metrics({"checkpoints_used": len(chosen), "last_step": record.steps[-1]})
    log.info("wrote %s (%d checkpoints, last step %d)", out, len(chosen), record.steps[-1])
    return record


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.average``."""
    return stage_main("average", lambda params, _: stage(params.average, train_dir=checkpoint_folder(params),
                                                         bpe_dir=params.paths.bpe, model_dir=params.paths.model), argv)


if __name__ == "__main__":
    sys.exit(main())

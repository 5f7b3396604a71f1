"""Stage ``evaluate``: decode valid and test with the averaged model (beam and α chosen on valid), and valid with
the newest checkpoint (the paper's Table 3 reports single models), and score against the raw references."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

from pipeline.artifacts import model_file
from pipeline.core.config import EvaluateConfig, checkpoint_folder
from pipeline.core.details import EvaluateDetails, SetFigures
from pipeline.core.owned import atomic_path, refuse_foreign
from pipeline.data.shard_reader import ShardSet
from pipeline.inference import scored_decoding
from pipeline.inference.decoding import load_translator
from pipeline.inference.scoring import METRIC_KEYS
from pipeline.tracking.harness import stage_main

log = logging.getLogger(__name__)

SETS = ("valid", "test")
NEWEST_HYP = f"valid.newest.hyp.{scored_decoding.TARGET_LANG}"


def _log_run(report: EvaluateDetails) -> None:
    """Metrics and tags of the stage's MLflow run; the averaging warning."""
    from pipeline import tracking

    run = tracking.current()
    valid, test, newest = report.valid, report.test, report.valid_newest
    beam, alpha = report.chosen.beam, report.chosen.alpha
    run.log_metrics({f"{split}.{key}": getattr(figures, key) for split, figures in (("valid", valid), ("test", test))
                     for key in (*METRIC_KEYS, "sentences_per_second", "decode_seconds")})
    run.log_metrics({f"grid.beam{e.beam}.alpha{e.alpha:g}.valid_bleu": e.bleu for e in report.grid})
    run.log_metrics({"valid.ppl": valid.ppl, "valid_newest.bleu": newest.bleu, "valid_newest.ppl": newest.ppl})
    run.set_tags({"sacrebleu_signature": test.signatures["bleu"],
                  **{f"signature.{k}": v for k, v in test.signatures.items()},
                  "chosen_beam": beam, "chosen_alpha": alpha})
    log.info("test BLEU %.2f (%s), valid %.2f (ppl %.2f); beam %d, alpha %g", test.bleu, test.signatures["bleu"],
             valid.bleu, valid.ppl, beam, alpha)
    log.info("newest checkpoint %s (step %d): valid BLEU %.2f, ppl %.2f", newest.checkpoint, newest.step,
             newest.bleu, newest.ppl)
    if (newest.bleu or 0.0) > (valid.bleu or 0.0):
        log.warning("averaging hurt: the newest checkpoint %s scores valid BLEU %.2f, the averaged model %.2f "
                    "(beam %d, alpha %g)", newest.checkpoint, newest.bleu, valid.bleu, beam, alpha)


def stage(cfg: EvaluateConfig, *, model_dir: str | Path, shards_dir: str | Path, raw_dir: str | Path,
          eval_dir: str | Path, train_dir: str | Path, spm_model: str | Path) -> EvaluateDetails:
    """Decode valid (grid) and test (chosen beam, α) with the averaged model, valid with the newest checkpoint of
    ``train_dir``, into ``eval_dir`` (written whole); every input is checked before the first decode.

    Returns:
        Per set every figure and signature (valid also ``nll``/``ppl``), the grid, the chosen beam and α,
        the device, and ``valid_newest``: the newest checkpoint's step, folder, valid figures and perplexity.
    """
    refuse_foreign(Path(eval_dir), "eval")  # before the work, not only at the swap
    translator = load_translator(model_file.path_in(model_dir))
    log.info("evaluating on %s", translator.device)
    valid, test = (scored_decoding.load_set(shards_dir, raw_dir, split, translator) for split in SETS)
    step, folder = scored_decoding.newest_checkpoint(train_dir)
    newest = scored_decoding.checkpoint_translator(folder, spm_model)  # on CPU until the averaged model is done
    newest_valid = scored_decoding.load_set(shards_dir, raw_dir, "valid", newest)
    valid_shards = ShardSet(shards_dir, "valid")
    with atomic_path(eval_dir, role="eval") as out:  # the folder whole: replaced only if this stage wrote it
        out.mkdir()
        report = scored_decoding.evaluate_averaged(cfg, translator, valid, test, {
            split: out / f"{split}.hyp.{scored_decoding.TARGET_LANG}" for split in SETS})
        averaged_valid = scored_decoding.with_perplexity(report.valid, translator.model, valid_shards, cfg.max_tokens)
        translator.model.to("cpu")  # one model on the accelerator at a time
        newest.model.to(translator.device)
        newest = dataclasses.replace(newest, device=translator.device)
        beam, alpha = report.chosen.beam, report.chosen.alpha
        assert beam is not None and alpha is not None  # evaluate_averaged chose them
        figures = scored_decoding.decode_and_score(cfg, newest, newest_valid, out / NEWEST_HYP, label="valid newest",
                                              beam=beam, alpha=alpha)
        figures = scored_decoding.with_perplexity(figures.replace(step=step, checkpoint=str(folder)), newest.model,
                                             valid_shards, cfg.max_tokens)

    def moved(entry: SetFigures) -> SetFigures:  # the hypotheses where they now are
        return entry.replace(hypotheses=str(Path(eval_dir) / Path(entry.hypotheses or "").name))

    report = report.replace(valid=moved(averaged_valid), test=moved(report.test), valid_newest=moved(figures))
    _log_run(report)
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.evaluate``."""
    return stage_main("evaluate", lambda params, _: stage(
        params.evaluate, model_dir=params.paths.model, shards_dir=params.paths.shards, raw_dir=params.paths.raw,
        eval_dir=params.paths.eval, train_dir=checkpoint_folder(params),
        spm_model=Path(params.paths.bpe) / "spm.model"), argv)


if __name__ == "__main__":
    sys.exit(main())

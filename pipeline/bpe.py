"""Stage ``bpe``: a joint SentencePiece BPE model over the cleaned training text (EN and DE), learnt from a seeded
sample streamed in file order (:mod:`pipeline.data.sample`), so the same text and seed give the same bytes."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from model.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from pipeline import tracking
from pipeline.core.config import BpeConfig
from pipeline.core.data_details import BpeDetails
from pipeline.core.errors import DataError
from pipeline.core.owned import atomic_path
from pipeline.core.textio import sha256_file
from pipeline.data.sample import Sample
from pipeline.tracking.harness import stage_main

log = logging.getLogger(__name__)

SPECIAL_PIECES = {"pad_piece": "<pad>", "unk_piece": "<unk>", "bos_piece": "<s>", "eos_piece": "</s>"}


def train_model(sample: Path | Iterable[str], model_prefix: Path, cfg: BpeConfig, num_threads: int) -> None:
    """Train SentencePiece BPE on ``sample`` (a text file or the sentences) into ``<prefix>.model``/``.vocab``."""
    import sentencepiece as spm

    source = {"input": str(sample)} if isinstance(sample, Path) else {"sentence_iterator": iter(sample)}
    try:
        spm.SentencePieceTrainer.train(
            **source, model_prefix=str(model_prefix), model_type="bpe",
            vocab_size=cfg.vocab_size, character_coverage=cfg.character_coverage,
            input_sentence_size=0, shuffle_input_sentence=False,  # the sample is ours, in a fixed order
            normalization_rule_name="identity",  # clean normalised the text; decoding must give it back exactly
            num_threads=num_threads, pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, **SPECIAL_PIECES,
            minloglevel=1)
    except RuntimeError as exc:
        hint = ("lower bpe.vocab_size in params.yaml" if "Vocabulary size" in str(exc)
                else "check the cleaned training text")
        what = sample if isinstance(sample, Path) else "the sample"
        raise DataError(f"SentencePiece training on {what} failed: {exc}; {hint}") from None
    _canonicalise(model_prefix.with_suffix(".model"))


def _canonicalise(model_file: Path) -> None:
    """Replace the input path, output prefix and thread count SentencePiece records in the model by constants (the
    pieces do not depend on them), so the same text gives the same bytes on any machine."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    proto.trainer_spec.ClearField("input")
    proto.trainer_spec.model_prefix = "spm"
    proto.trainer_spec.num_threads = 1
    model_file.write_bytes(proto.SerializeToString(deterministic=True))


def stage(cfg: BpeConfig, *, clean_dir: str | Path, bpe_dir: str | Path) -> BpeDetails:
    """Run the bpe stage: ``<clean_dir>/train.{en,de}`` → ``<bpe_dir>/spm.{model,vocab}`` (atomically); return the
    sample's sentence count, the vocabulary size and the model's sha256.

    Raises:
        DataError: missing or empty cleaned text, bad UTF-8 (file:line), or a vocabulary the text cannot fill.
    """
    clean_dir, bpe_dir = Path(clean_dir), Path(bpe_dir)
    files = [clean_dir / "train.en", clean_dir / "train.de"]
    for path in files:
        if not path.is_file():
            raise DataError(f"{path}: missing; run `dvc repro clean` first")
    threads = os.cpu_count() or 1
    sample = Sample(files, cfg.input_sentence_size, cfg.seed)
    no_text = f"{files[0]} and {files[1]} hold no text; rerun `dvc repro clean`"
    if len(sample.chosen) == 0:
        raise DataError(no_text)
    with atomic_path(bpe_dir, role="bpe") as tmp:
        tmp.mkdir()
        log.info("bpe: training a %d-piece model on up to %d sentences with %d threads (SentencePiece reads "
                 "them all, then learns the merges without reporting progress)", cfg.vocab_size, len(sample.chosen),
                 threads)
        started = time.monotonic()
        try:
            train_model(sample, tmp / "spm", cfg, threads)
        except DataError:
            if sample.error is not None:
                raise sample.error from None
            if sample.count == 0:  # only empty lines: SentencePiece had nothing to learn from
                raise DataError(no_text) from None
            raise
    n = sample.count
    log.info("bpe: trained on %d sentences in %.0f s", n, time.monotonic() - started)
    tracking.current().log_metrics({"sentences": n})
    return BpeDetails(sentences=n, vocab_size=cfg.vocab_size, spm_sha256=sha256_file(bpe_dir / "spm.model"))


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.bpe [--params params.yaml]``."""
    return stage_main("bpe", lambda params, _: stage(params.bpe, clean_dir=params.paths.clean,
                                                     bpe_dir=params.paths.bpe), argv)


if __name__ == "__main__":
    sys.exit(main())

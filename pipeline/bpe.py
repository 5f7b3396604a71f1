"""Stage ``bpe``: a joint SentencePiece BPE model over the cleaned training text (EN and DE).

The model is trained on a seeded sample of at most ``bpe.input_sentence_size`` sentences drawn
by this module (not by SentencePiece) and streamed to SentencePiece in file order through its
``sentence_iterator`` (no temporary copy of the text: at the paper's sample size that copy would be
the whole 1.3 GB corpus), so the same cleaned text and seed give the same ``spm.model`` bytes.
Ids are fixed: pad=0, unk=1, bos=2, eos=3.
SentencePiece's own normalisation is ``identity``: the text is already normalised by ``clean``
(NFC), and decoding must give back exactly the cleaned text.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from model.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from pipeline.core.config import BpeConfig, Params
from pipeline.core.errors import DataError
from pipeline.core.stage import stage_main
from pipeline.core.textio import atomic_path, line_offsets, read_line_block, sha256_file

log = logging.getLogger(__name__)

PROGRESS_EVERY = 1_000_000  # sentences between progress lines while SentencePiece reads the sample
READ_BLOCK = 100_000  # lines read and decoded at once
SPECIAL_PIECES = {"pad_piece": "<pad>", "unk_piece": "<unk>", "bos_piece": "<s>", "eos_piece": "</s>"}


def sample_indices(total: int, k: int, seed: int) -> np.ndarray:
    """Sorted indices of a seeded sample of ``min(k, total)`` distinct lines out of ``total``."""
    if k <= 0 or k >= total:
        return np.arange(total, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(seed))
    return np.sort(rng.choice(total, size=k, replace=False)).astype(np.int64)


class Sample:
    """A seeded sample of the lines of ``files`` (taken as one sequence), iterated in file order.

    Empty lines are skipped; ``count`` is the number of sentences yielded so far. The files are read
    as they are iterated, so the sample never exists as a list or a file. A :class:`DataError` met
    while reading (invalid UTF-8, a NUL byte) is kept in ``error``: SentencePiece turns an exception
    in its iterator into a ``RuntimeError`` that has lost the file and line.
    """

    def __init__(self, files: list[Path], k: int, seed: int) -> None:
        self.files = files
        self.offsets: list[list[int]] = []
        self.counts: list[int] = []
        for path in files:
            offsets, n = line_offsets(path, READ_BLOCK)
            self.offsets.append(offsets)
            self.counts.append(n)
        self.chosen = sample_indices(sum(self.counts), k, seed)
        self.count = 0
        self.error: DataError | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._lines()
        except DataError as exc:
            self.error = exc
            raise

    def _lines(self) -> Iterator[str]:
        """The chosen lines, read and decoded a block at a time (a line at a time costs more than the rest)."""
        self.count = base = 0
        chosen = self.chosen
        for path, offsets, n in zip(self.files, self.offsets, self.counts):
            for k, (start, end) in enumerate(zip(offsets, offsets[1:] + [-1])):
                lines = read_line_block(path, start, end, k * READ_BLOCK)
                first = base + k * READ_BLOCK
                lo, hi = np.searchsorted(chosen, [first, first + len(lines)]).tolist()
                picked = lines if hi - lo == len(lines) else [lines[i - first] for i in chosen[lo:hi].tolist()]
                picked = [line for line in picked if line]
                if (self.count + len(picked)) // PROGRESS_EVERY > self.count // PROGRESS_EVERY:
                    log.info("bpe: %d/%d sampled lines read", hi, len(chosen))
                self.count += len(picked)
                yield from picked
            base += n
        log.info("bpe: all %d sentences of the sample read", self.count)


def write_sample(files: list[Path], out: Path, k: int, seed: int) -> int:
    """Write :class:`Sample` ``(files, k, seed)`` to ``out``, a line each; returns the number of sentences."""
    sample = Sample(files, k, seed)
    with open(out, "w", encoding="utf-8", newline="\n") as fh:
        for line in sample:
            fh.write(line + "\n")
    return sample.count


def train_model(sample: Path | Iterable[str], model_prefix: Path, cfg: BpeConfig, num_threads: int) -> None:
    """Train SentencePiece BPE on every sentence of ``sample``; writes ``<prefix>.model``/``.vocab``.

    Args:
        sample: a text file (one sentence a line) or the sentences themselves, in training order.
    """
    import sentencepiece as spm

    source = {"input": str(sample)} if isinstance(sample, Path) else {"sentence_iterator": iter(sample)}
    try:
        spm.SentencePieceTrainer.train(
            **source, model_prefix=str(model_prefix), model_type="bpe",
            vocab_size=cfg.vocab_size, character_coverage=cfg.character_coverage,
            input_sentence_size=0, shuffle_input_sentence=False,  # the sample is ours, in a fixed order
            normalization_rule_name="identity", num_threads=num_threads,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, **SPECIAL_PIECES,
            minloglevel=1,
        )
    except RuntimeError as exc:
        hint = ("lower bpe.vocab_size in params.yaml" if "Vocabulary size" in str(exc)
                else "check the cleaned training text")
        what = sample if isinstance(sample, Path) else "the sample"
        raise DataError(f"SentencePiece training on {what} failed: {exc}; {hint}") from None
    _canonicalise(model_prefix.with_suffix(".model"))


def _canonicalise(model_file: Path) -> None:
    """Rewrite the machine-dependent trainer fields SentencePiece records inside the model.

    The model proto stores the input path, the output prefix and the thread count; the pieces
    and scores do not depend on them (checked: 1 and N threads give the same pieces), so they
    are replaced by constants and the same text gives the same bytes on any machine.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    proto.trainer_spec.ClearField("input")
    proto.trainer_spec.model_prefix = "spm"
    proto.trainer_spec.num_threads = 1
    model_file.write_bytes(proto.SerializeToString(deterministic=True))


def stage(cfg: BpeConfig, *, clean_dir: str | Path, bpe_dir: str | Path) -> dict:
    """Run the bpe stage: ``<clean_dir>/train.{en,de}`` → ``<bpe_dir>/spm.{model,vocab}``.

    Returns:
        The sample's sentence count, the vocabulary size and the model's sha256.

    Raises:
        DataError: missing cleaned text, an empty training set, invalid UTF-8 or a NUL byte (file:line),
            or a vocabulary the text cannot fill.
        OutputError: the disk filled up while writing (the previous ``bpe_dir`` is kept).
    """
    from pipeline.core import tracking

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
    return {"sentences": n, "vocab_size": cfg.vocab_size, "spm_sha256": sha256_file(bpe_dir / "spm.model")}


def _run(params: Params, args: argparse.Namespace) -> dict:
    return stage(params.bpe, clean_dir=params.paths.clean, bpe_dir=params.paths.bpe)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m pipeline.bpe [--params params.yaml]``."""
    return stage_main("bpe", _run, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Measure the (source, target) BPE length histogram of real news text for tests/data/news_lengths.json.

The batch-size test (tests/pipeline/data/test_global_batches.py) plans the paper profile's global
batches on this histogram. How it was measured, once:

    .venv/bin/python benchmarks/news_lengths.py --data ../shared/data/wmt14/dev --out tests/data/news_lengths.json

Input: the EN-DE news sets of WMT14's dev.tgz (news-test2008, newssyscomb2009, newstest2009-2013).
The pipeline's own BPE (pipeline.bpe.train_model with the paper profile's ``bpe`` section: joint
SentencePiece BPE, 37,000 pieces) is trained on both sides of those sets, every pair is encoded,
pairs longer than the paper profile's ``encode.max_len`` are dropped (as the encode stage does), and
the counts of each (source length, target length) are written. Real WMT14 training text is not
available offline; news text has WMT-like sentence lengths.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import tempfile
from pathlib import Path

from pipeline.bpe import train_model
from pipeline.core.config import load_params

log = logging.getLogger(__name__)
SETS = ("news-test2008", "newssyscomb2009", "newstest2009", "newstest2010", "newstest2011", "newstest2012",
        "newstest2013")


def main() -> None:
    """Train the BPE, encode the news sets, write the histogram."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="folder with <set>.en / <set>.de")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    params = load_params(Path(__file__).resolve().parents[1] / "profiles" / "paper.yaml")
    pairs = []
    for name in SETS:
        en = (args.data / f"{name}.en").read_text(encoding="utf-8").rstrip("\n").split("\n")
        de = (args.data / f"{name}.de").read_text(encoding="utf-8").rstrip("\n").split("\n")
        pairs += [(e, d) for e, d in zip(en, de, strict=True) if e.strip() and d.strip()]
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        sample = Path(tmp) / "sample.txt"
        sample.write_text("".join(f"{e}\n{d}\n" for e, d in pairs), encoding="utf-8")
        train_model(sample, Path(tmp) / "spm", params.bpe, num_threads=2)
        sp = spm.SentencePieceProcessor(model_file=str(Path(tmp) / "spm.model"))
        src = sp.encode([e for e, _ in pairs])
        tgt = sp.encode([d for _, d in pairs])
    limit = params.encode.max_len
    counts = collections.Counter((len(s), len(t)) for s, t in zip(src, tgt) if len(s) <= limit and len(t) <= limit)
    out = {"how": "benchmarks/news_lengths.py (see its docstring)", "sets": list(SETS),
           "bpe_vocab_size": params.bpe.vocab_size, "max_len": limit, "pairs": sum(counts.values()),
           "histogram": [[s, t, n] for (s, t), n in sorted(counts.items())]}
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")
    log.info("%d pairs, %d distinct (source, target) lengths -> %s", out["pairs"], len(counts), args.out)


if __name__ == "__main__":
    main()

"""BLEU and chrF against untouched references: sacreBLEU's figures plus the paper's tokenized BLEU.

sacreBLEU (detokenised text in, its own tokenisers) gives the shareable numbers, each with its
signature: BLEU 13a cased (the primary figure), 13a lowercased, intl cased, intl lowercased, chrF2.

The paper's 27.3 was computed differently (L. Kaiser, tensor2tensor issue #61; t2t's
``get_ende_bleu.sh``): hypothesis and reference are Moses-tokenised, hyphenated compounds are split
(``Test-Fall`` → ``Test ##AT##-##AT## Fall``) and multi-bleu scores the tokens. We reproduce that
with sacremoses (``escape=False``, lang de) and sacreBLEU's BLEU with ``tokenize='none'`` and no
smoothing (multi-bleu's rule: any zero n-gram precision gives 0).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sacrebleu.metrics import BLEU, CHRF
from sacremoses import MosesTokenizer

from pipeline.core.errors import DataError
from pipeline.core.textio import read_lines

#: metric key → sacreBLEU constructor arguments (the first is the primary figure).
SACREBLEU_METRICS: dict[str, tuple[type, dict[str, Any]]] = {
    "bleu": (BLEU, {"tokenize": "13a", "lowercase": False}),
    "bleu_lc": (BLEU, {"tokenize": "13a", "lowercase": True}),
    "bleu_intl": (BLEU, {"tokenize": "intl", "lowercase": False}),
    "bleu_intl_lc": (BLEU, {"tokenize": "intl", "lowercase": True}),
    "chrf2": (CHRF, {}),  # char order 6, word order 0, beta 2
}
#: the paper's way: Moses tokens + compound splitting, multi-bleu style.
TOKENIZED_METRIC = "bleu_tok_split"
METRIC_KEYS: tuple[str, ...] = (*SACREBLEU_METRICS, TOKENIZED_METRIC)

_COMPOUND_HYPHEN = re.compile(r"(?<=\w)-(?=\w)")


def compound_split(text: str) -> str:
    """Split hyphenated compounds as t2t's ``get_ende_bleu.sh`` does before multi-bleu.

    A ``-`` between two word characters becomes `` ##AT##-##AT## ``. Unlike the perl one-liner
    ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g`` (which skips the second hyphen of ``a-b-c`` because the
    match consumed ``b``), every such hyphen is split, and a hyphen next to a space or punctuation
    (``- ``, ``--``, ``-3`` after a space) is left alone.

    >>> compound_split("E-Mail-Adresse")
    'E ##AT##-##AT## Mail ##AT##-##AT## Adresse'
    """
    return _COMPOUND_HYPHEN.sub(" ##AT##-##AT## ", text)


def tokenize_for_paper_bleu(lines: Sequence[str], lang: str = "de") -> list[str]:
    """Moses-tokenise (no XML escaping, no aggressive dash splits) then compound-split each line."""
    tok = MosesTokenizer(lang=lang)
    return [compound_split(tok.tokenize(line, escape=False, return_str=True)) for line in lines]


def primary_bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """sacreBLEU BLEU 13a cased (the figure the beam/α grid is chosen by)."""
    cls, kwargs = SACREBLEU_METRICS["bleu"]
    return float(cls(**kwargs).corpus_score(list(hyps), [list(refs)]).score)


def score_corpus(hyps: Sequence[str], refs: Sequence[str], lang: str = "de") -> dict[str, Any]:
    """Corpus scores of ``hyps`` against one reference per line.

    Args:
        hyps: detokenised hypotheses, one per sentence.
        refs: the untouched reference lines, same length.
        lang: target language (Moses tokeniser rules for the paper's BLEU).

    Returns:
        ``{key: score for key in METRIC_KEYS, "signatures": {key: sacreBLEU signature},
        "verbose": {key: sacreBLEU's one-line detail}}``.

    Raises:
        DataError: different numbers of lines.
    """
    if len(hyps) != len(refs):
        raise DataError(f"{len(hyps)} hypotheses but {len(refs)} references: every line needs a translation")
    out: dict[str, Any] = {"signatures": {}, "verbose": {}}
    for key, (cls, kwargs) in SACREBLEU_METRICS.items():
        metric = cls(**kwargs)
        result = metric.corpus_score(list(hyps), [list(refs)])
        out[key] = float(result.score)
        out["signatures"][key] = metric.get_signature().format()
        out["verbose"][key] = result.format()
    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    result = metric.corpus_score(tokenize_for_paper_bleu(hyps, lang), [tokenize_for_paper_bleu(refs, lang)])
    out[TOKENIZED_METRIC] = float(result.score)
    out["signatures"][TOKENIZED_METRIC] = f"moses:{lang}|compound-split|" + metric.get_signature().format()
    out["verbose"][TOKENIZED_METRIC] = result.format()
    return out


def score_files(hyp_path: str | Path, ref_path: str | Path, lang: str = "de") -> dict[str, Any]:
    """:func:`score_corpus` over two UTF-8 files (split on ``\\n`` only), plus ``sentences``.

    Raises:
        DataError: the files have different line counts (names both) or invalid UTF-8.
    """
    hyps = list(read_lines(hyp_path))
    refs = list(read_lines(ref_path))
    if len(hyps) != len(refs):
        raise DataError(
            f"{hyp_path} has {len(hyps)} lines but the reference {ref_path} has {len(refs)}: "
            "the hypothesis file must keep every line of the set (empty output lines included); "
            "rerun the evaluate stage on the complete, unfiltered set"
        )
    scores = score_corpus(hyps, refs, lang)
    scores["sentences"] = len(refs)
    return scores

"""BLEU and chrF against untouched references: sacreBLEU's figures (BLEU 13a cased first) plus the paper's tokenized
BLEU, which repeats tensor2tensor's ``get_ende_bleu.sh`` on both sides (docs/paper-bleu.md says how and why)."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from sacrebleu.metrics import BLEU, CHRF
from sacremoses import MosesTokenizer

from pipeline.core.errors import DataError
from pipeline.core.figures import SetFigures
from pipeline.core.textio import read_lines

#: metric key → sacreBLEU constructor arguments (the first is the primary figure).
SACREBLEU_METRICS: dict[str, tuple[type, dict[str, str | bool]]] = {
    "bleu": (BLEU, {"tokenize": "13a", "lowercase": False}),
    "bleu_lc": (BLEU, {"tokenize": "13a", "lowercase": True}),
    "bleu_intl": (BLEU, {"tokenize": "intl", "lowercase": False}),
    "bleu_intl_lc": (BLEU, {"tokenize": "intl", "lowercase": True}),
    "chrf2": (CHRF, {}),  # char order 6, word order 0, beta 2
}
#: the paper's way: t2t's get_ende_bleu.sh (Moses tokens + ATAT compound split, multi-bleu).
TOKENIZED_METRIC = "bleu_tok_split"
METRIC_KEYS: tuple[str, ...] = (*SACREBLEU_METRICS, TOKENIZED_METRIC)

#: replace-unicode-punctuation.perl (moses-smt/mosesdecoder scripts/tokenizer/), its ``s///g`` in
#: its order: (regular expression, replacement). Only ``。`` and ``．`` take the spaces after them.
UNICODE_PUNCTUATION: tuple[tuple[str, str], ...] = (
    ("\uff0c", ","),     # ， FULLWIDTH COMMA
    ("\u3002 *", ". "),  # 。 IDEOGRAPHIC FULL STOP, and the spaces after it
    ("\u3001", ","),     # 、 IDEOGRAPHIC COMMA
    ("\u201d", '"'),     # ” RIGHT DOUBLE QUOTATION MARK
    ("\u201c", '"'),     # “ LEFT DOUBLE QUOTATION MARK
    ("\u2236", ":"),     # ∶ RATIO
    ("\uff1a", ":"),     # ： FULLWIDTH COLON
    ("\uff1f", "?"),     # ？ FULLWIDTH QUESTION MARK
    ("\u300a", '"'),     # 《 LEFT DOUBLE ANGLE BRACKET
    ("\u300b", '"'),     # 》 RIGHT DOUBLE ANGLE BRACKET
    ("\uff09", ")"),     # ） FULLWIDTH RIGHT PARENTHESIS
    ("\uff01", "!"),     # ！ FULLWIDTH EXCLAMATION MARK
    ("\uff08", "("),     # （ FULLWIDTH LEFT PARENTHESIS
    ("\uff1b", ";"),     # ； FULLWIDTH SEMICOLON
    ("\uff11", '"'),     # １ FULLWIDTH DIGIT ONE (a quote in the script, kept as it is)
    ("\u300d", '"'),     # 」 RIGHT CORNER BRACKET
    ("\u300c", '"'),     # 「 LEFT CORNER BRACKET
    ("\uff10", "0"),     # ０ FULLWIDTH DIGIT ZERO
    ("\uff13", "3"),     # ３ FULLWIDTH DIGIT THREE
    ("\uff12", "2"),     # ２ FULLWIDTH DIGIT TWO
    ("\uff15", "5"),     # ５ FULLWIDTH DIGIT FIVE
    ("\uff16", "6"),     # ６ FULLWIDTH DIGIT SIX
    ("\uff19", "9"),     # ９ FULLWIDTH DIGIT NINE
    ("\uff17", "7"),     # ７ FULLWIDTH DIGIT SEVEN
    ("\uff18", "8"),     # ８ FULLWIDTH DIGIT EIGHT
    ("\uff14", "4"),     # ４ FULLWIDTH DIGIT FOUR
    ("\uff0e *", ". "),  # ． FULLWIDTH FULL STOP, and the spaces after it
    ("\uff5e", "~"),     # ～ FULLWIDTH TILDE
    ("\u2019", "'"),     # ’ RIGHT SINGLE QUOTATION MARK
    ("\u2026", "..."),   # … HORIZONTAL ELLIPSIS
    ("\u2501", "-"),     # ━ BOX DRAWINGS HEAVY HORIZONTAL
    ("\u3008", "<"),     # 〈 LEFT ANGLE BRACKET
    ("\u3009", ">"),     # 〉 RIGHT ANGLE BRACKET
    ("\u3010", "["),     # 【 LEFT BLACK LENTICULAR BRACKET
    ("\u3011", "]"),     # 】 RIGHT BLACK LENTICULAR BRACKET
    ("\uff05", "%"),     # ％ FULLWIDTH PERCENT SIGN
)
_UNICODE_PUNCTUATION = tuple((re.compile(pattern), repl) for pattern, repl in UNICODE_PUNCTUATION)

#: get_ende_bleu.sh's ``s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g``, on bytes as ``perl -ple`` runs it.
_ATAT = re.compile(rb"(\S)-(\S)")
#: names the steps in front of sacreBLEU's own signature for :data:`TOKENIZED_METRIC`.
_TOKENIZED_SIGNATURE = "t2t-get_ende_bleu:replace-unicode-punct+moses-tok-{lang}+atat|"


def replace_unicode_punctuation(text: str) -> str:
    """Apply Moses' ``replace-unicode-punctuation.perl`` to one line (its patterns are whole characters).

    >>> replace_unicode_punctuation("„Ja“，sagte er…")
    '„Ja",sagte er...'
    """
    for pattern, repl in _UNICODE_PUNCTUATION:
        text = pattern.sub(repl, text)
    return text


def compound_split(text: str) -> str:
    """Split hyphenated compounds exactly as t2t's ``get_ende_bleu.sh`` does, on the UTF-8 bytes as Perl does.

    Matches do not overlap and any non-space byte counts (``x--y`` → ``x ##AT##-##AT## -y``).

    >>> compound_split("E-Mail-Adresse")
    'E ##AT##-##AT## Mail ##AT##-##AT## Adresse'
    >>> compound_split("Howl-O-Scream")
    'Howl ##AT##-##AT## O-Scream'
    """
    return _ATAT.sub(rb"\1 ##AT##-##AT## \2", text.encode("utf-8")).decode("utf-8")


@functools.lru_cache(maxsize=8)
def _moses(lang: str) -> MosesTokenizer:
    """One sacremoses tokeniser per language (loading the non-breaking prefixes costs time)."""
    return MosesTokenizer(lang=lang)


def tokenize_for_paper_bleu(lines: Sequence[str], lang: str = "de") -> list[str]:
    """Steps 1 to 3 of ``get_ende_bleu.sh`` on each detokenised line: unicode punctuation replaced, Moses tokens
    (``lang``, XML escaping, no aggressive dash splits), compounds ATAT-split; space-separated tokens per line."""
    tok = _moses(lang)
    return [
        compound_split(tok.tokenize(replace_unicode_punctuation(line), aggressive_dash_splits=False,
                                    return_str=True, escape=True))
        for line in lines
    ]


def primary_bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """sacreBLEU BLEU 13a cased (the figure the beam/α grid is chosen by)."""
    cls, kwargs = SACREBLEU_METRICS["bleu"]
    return float(cls(**kwargs).corpus_score(list(hyps), [list(refs)]).score)


def score_corpus(hyps: Sequence[str], refs: Sequence[str], lang: str = "de") -> SetFigures:
    """Corpus scores of detokenised ``hyps`` against the untouched ``refs`` (one per line), ``lang`` the target.

    Returns:
        Every score of METRIC_KEYS, its ``signatures`` and ``verbose`` detail line, and the ``sentences``.

    Raises:
        DataError: different numbers of lines.
    """
    if len(hyps) != len(refs):
        raise DataError(f"{len(hyps)} hypotheses but {len(refs)} references: every line needs a translation")
    scores: dict[str, float] = {}
    signatures: dict[str, str] = {}
    verbose: dict[str, str] = {}
    for key, (cls, kwargs) in SACREBLEU_METRICS.items():
        metric = cls(**kwargs)
        result = metric.corpus_score(list(hyps), [list(refs)])
        scores[key], verbose[key] = float(result.score), result.format()
        signatures[key] = metric.get_signature().format()
    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    result = metric.corpus_score(tokenize_for_paper_bleu(hyps, lang), [tokenize_for_paper_bleu(refs, lang)])
    scores[TOKENIZED_METRIC] = float(result.score)
    signatures[TOKENIZED_METRIC] = _TOKENIZED_SIGNATURE.format(lang=lang) + metric.get_signature().format()
    verbose[TOKENIZED_METRIC] = result.format()
    return SetFigures(bleu=scores["bleu"], bleu_lc=scores["bleu_lc"], bleu_intl=scores["bleu_intl"],
                      bleu_intl_lc=scores["bleu_intl_lc"], chrf2=scores["chrf2"],
                      bleu_tok_split=scores[TOKENIZED_METRIC], signatures=signatures, verbose=verbose,
                      sentences=len(refs))


def score_files(hyp_path: str | Path, ref_path: str | Path, lang: str = "de") -> SetFigures:
    """:func:`score_corpus` over two UTF-8 files (split on ``\\n`` only).

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
    return score_corpus(hyps, refs, lang)

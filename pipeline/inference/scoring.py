"""BLEU and chrF against untouched references: sacreBLEU's figures plus the paper's tokenized BLEU.

sacreBLEU (detokenised text in, its own tokenisers) gives the shareable numbers, each with its
signature: BLEU 13a cased (the primary figure), 13a lowercased, intl cased, intl lowercased, chrF2.

The paper's 27.3 was computed with tensor2tensor's evaluation script (L. Kaiser,
https://github.com/tensorflow/tensor2tensor/issues/61): ``tensor2tensor/utils/get_ende_bleu.sh`` in
the repository tensorflow/tensor2tensor, in its later form with the replace-unicode step (the first
form went straight to the tokeniser). For the hypotheses it runs, with scripts from the repository
moses-smt/mosesdecoder:

1. ``scripts/tokenizer/replace-unicode-punctuation.perl -l de``: 36 fixed substitutions of CJK and
   full-width punctuation, ``“``/``”`` → ``"``, ``’`` → ``'``, ``…`` → ``...``. The script ignores
   ``-l``; it leaves ``„``, ``‚``, ``‘``, ``«``, ``»`` and dashes alone and, as written there, turns a
   full-width ``１`` into ``"``. See :func:`replace_unicode_punctuation`.
2. ``scripts/tokenizer/tokenizer.perl -l de`` with default options: XML escaping on (``&`` →
   ``&amp;``, ``"`` → ``&quot;``, ``'`` → ``&apos;``, also ``<``, ``>``, ``|``, ``[``, ``]``), no
   ``-a`` (no aggressive hyphen splitting). Here sacremoses' ``MosesTokenizer(lang="de")``, a port
   of that script that follows current Moses (the 2017 Moses may differ on rare lines).
3. ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``, the "ATAT" compound split. See
   :func:`compound_split`.
4. ``scripts/generic/multi-bleu.perl`` against the ATAT-split reference.

The script leaves the reference side implicit: it only ATAT-splits a ready-made
``newstest2013.tok.de``. We read that as the same chain applied to the untouched reference (steps 1
to 3). It is the only raw-text-to-tokens recipe in the script, ``.tok`` names tokenizer.perl's
output, and only a symmetric chain lets a hypothesis equal to the reference score 100 (step 1 on
the hypothesis alone would turn its ``“`` into ``&quot;`` while the reference kept ``“``). Not
reproduced: the hand-normalised reference that t2t distributed, in which every Unicode quote,
``„`` included, had been turned into ``"`` before tokenisation (M. Popel,
https://github.com/tensorflow/tensor2tensor/issues/317). No script produces that file.

The ATAT split keeps Perl's semantics exactly. ``perl -ple`` without ``-C`` or ``use utf8`` works
on the UTF-8 bytes, ``\\S`` is any byte but ASCII whitespace, and ``/g`` takes non-overlapping
matches from left to right. So the character after a split hyphen is consumed and cannot start the
next match: ``a-b-c`` → ``a ##AT##-##AT## b-c`` and ``1.-3`` → ``1. ##AT##-##AT## 3``, while
``A-Ö-B`` splits twice (only the first byte of ``Ö`` is consumed). Python's bytes-mode ``re`` has
the same ``\\S`` (not ``[ \\t\\n\\r\\f\\v]``, like the native ``\\s`` of Perl 5.18 and later) and
the same scan in ``sub``.

multi-bleu is sacreBLEU's ``BLEU(tokenize="none", smooth_method="none", force=True)`` on the token
strings. For one reference the two agree (checked against multi-bleu.perl's source): n-gram counts
are clipped by the reference, the brevity penalty is ``exp(1 - r/c)`` when ``c < r``, and a zero
n-gram precision gives 0 in both (multi-bleu's ``my_log(0)`` is ``-9999999999``, and so is
sacreBLEU's ``my_log(0)`` with no smoothing). Perl's ``split`` breaks on ASCII whitespace and
Python's ``str.split`` on any Unicode whitespace, which makes no difference after step 2: the
tokeniser folds all whitespace to one space and drops control characters. multi-bleu prints two
decimals; we keep full precision. The only gap is a hypothesis side with no tokens at all, where
multi-bleu.perl dies dividing by zero and sacreBLEU gives 0.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sacrebleu.metrics import BLEU, CHRF
from sacremoses import MosesTokenizer

from pipeline.core.errors import DataError
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
_ATAT_REPLACEMENT = rb"\1 ##AT##-##AT## \2"
#: names the steps in front of sacreBLEU's own signature for :data:`TOKENIZED_METRIC`.
_TOKENIZED_SIGNATURE = "t2t-get_ende_bleu:replace-unicode-punct+moses-tok-{lang}+atat|"


def replace_unicode_punctuation(text: str) -> str:
    """Apply Moses' ``replace-unicode-punctuation.perl`` to one line.

    The Perl script matches UTF-8 bytes; each of its patterns is a whole character's byte sequence
    (plus ``' *'``), so on valid UTF-8 matching characters gives the same result.

    >>> replace_unicode_punctuation("„Ja“，sagte er…")
    '„Ja",sagte er...'
    """
    for pattern, repl in _UNICODE_PUNCTUATION:
        text = pattern.sub(repl, text)
    return text


def compound_split(text: str) -> str:
    """Split hyphenated compounds exactly as t2t's ``get_ende_bleu.sh`` does before multi-bleu.

    ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``: on the UTF-8 bytes, a ``-`` with a
    non-whitespace byte on each side becomes `` ##AT##-##AT## ``. Matches do not overlap, so the
    byte after a split hyphen cannot be the left side of the next one (``a-b-c`` →
    ``a ##AT##-##AT## b-c``); any non-space counts, punctuation and a no-break space included
    (``x--y`` → ``x ##AT##-##AT## -y``). A hyphen can never fall inside a multi-byte character, so
    the result is valid UTF-8.

    >>> compound_split("E-Mail-Adresse")
    'E ##AT##-##AT## Mail ##AT##-##AT## Adresse'
    >>> compound_split("Howl-O-Scream")
    'Howl ##AT##-##AT## O-Scream'
    """
    return _ATAT.sub(_ATAT_REPLACEMENT, text.encode("utf-8")).decode("utf-8")


@functools.lru_cache(maxsize=8)
def _moses(lang: str) -> MosesTokenizer:
    """One sacremoses tokeniser per language (loading the non-breaking prefixes costs time)."""
    return MosesTokenizer(lang=lang)


def tokenize_for_paper_bleu(lines: Sequence[str], lang: str = "de") -> list[str]:
    """Steps 1 to 3 of ``get_ende_bleu.sh`` on each line (see the module docstring).

    Args:
        lines: detokenised text, one sentence per line (hypotheses or the untouched reference).
        lang: the Moses tokeniser's language (``tokenizer.perl -l``); the script uses ``de``.

    Returns:
        Space-separated tokens per line: unicode punctuation replaced, Moses-tokenised with XML
        escaping and no aggressive dash splits, compounds ATAT-split.
    """
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


def score_corpus(hyps: Sequence[str], refs: Sequence[str], lang: str = "de") -> dict[str, Any]:
    """Corpus scores of ``hyps`` against one reference per line.

    Args:
        hyps: detokenised hypotheses, one per sentence.
        refs: the untouched reference lines, same length.
        lang: target language (Moses tokeniser rules for the paper's BLEU).

    Returns:
        ``{key: score for key in METRIC_KEYS, "signatures": {key: sacreBLEU signature},
        "verbose": {key: sacreBLEU's one-line detail}}``. The signature of
        :data:`TOKENIZED_METRIC` names the ``get_ende_bleu.sh`` steps before sacreBLEU's own.

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
    out["signatures"][TOKENIZED_METRIC] = _TOKENIZED_SIGNATURE.format(lang=lang) + metric.get_signature().format()
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

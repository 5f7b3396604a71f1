"""BLEU scoring: sacreBLEU figures equal the sacrebleu command line's; the paper's tokenized BLEU."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from pipeline.core.errors import DataError
from pipeline.core.owned import write_lines
from pipeline.inference.scoring import (
    METRIC_KEYS,
    TOKENIZED_METRIC,
    UNICODE_PUNCTUATION,
    compound_split,
    replace_unicode_punctuation,
    score_corpus,
    score_files,
    tokenize_for_paper_bleu,
)

REFS = [
    "Gutach: Noch mehr Sicherheit für Fußgänger",
    ("Sie stehen keine 100 Meter voneinander entfernt: Am Dienstag ist in Gutach die neue B 33-Fußgängerampel "
     "in Betrieb genommen worden."),
    "Die E-Mail-Adresse lautet \"info@example.de\" – bitte nicht weitergeben!",
    "Zwei Anlagen so nah beieinander: Absicht oder Schildbürgerstreich?",
    "Diese Frage hat Gutachs Bürgermeister gestern klar beantwortet.",
    "",
    "Der Preis liegt bei 3,50 Euro (inkl. MwSt.).",
]
HYPS = [
    "Gutach: mehr Sicherheit für Fußgänger",
    "Sie sind keine 100 Meter entfernt: am Dienstag wurde in Gutach die neue B-33-Fußgängerampel eröffnet.",
    "Die E-Mail Adresse ist \"info@example.de\" - bitte nicht weitergeben.",
    "Zwei Anlagen so nah beieinander: Absicht oder Dummheit?",
    "Der Bürgermeister von Gutach hat diese Frage gestern klar beantwortet.",
    "Leer?",
    "Der Preis beträgt 3,50 Euro (inklusive MwSt.)",
]

CLI_ARGS = {
    "bleu": ["-m", "bleu", "-tok", "13a"],
    "bleu_lc": ["-m", "bleu", "-tok", "13a", "-lc"],
    "bleu_intl": ["-m", "bleu", "-tok", "intl"],
    "bleu_intl_lc": ["-m", "bleu", "-tok", "intl", "-lc"],
    "chrf2": ["-m", "chrf"],
}


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
    write_lines(hyp, HYPS)
    write_lines(ref, REFS)
    return hyp, ref


def _cli(ref: Path, hyp: Path, args: list[str]) -> dict:
    exe = shutil.which("sacrebleu")
    assert exe, "the sacrebleu command must be installed beside this interpreter"
    out = subprocess.run([exe, str(ref), "-i", str(hyp), *args, "--format", "json", "-w", "4"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return json.loads(out)


@pytest.mark.slow
def test_figures_equal_the_sacrebleu_command_line(files: tuple[Path, Path]) -> None:
    hyp, ref = files
    ours = score_files(hyp, ref)
    assert ours.sentences == len(REFS)
    for key, args in CLI_ARGS.items():
        cli = _cli(ref, hyp, args)
        assert f"{getattr(ours, key):.4f}" == f"{cli['score']:.4f}", key
        assert ours.signatures[key] == cli["signature"], key
    assert 0.0 < ours.bleu < 100.0


def test_paper_bleu_equals_the_command_line_on_moses_compound_split_files(files: tuple[Path, Path],
                                                                           tmp_path: Path) -> None:
    hyp, ref = files
    hyp_tok, ref_tok = tmp_path / "hyp.tok", tmp_path / "ref.tok"
    write_lines(hyp_tok, tokenize_for_paper_bleu(HYPS))
    write_lines(ref_tok, tokenize_for_paper_bleu(REFS))
    cli = _cli(ref_tok, hyp_tok, ["-m", "bleu", "-tok", "none", "-s", "none", "--force"])
    ours = score_files(hyp, ref)
    assert f"{ours.bleu_tok_split:.4f}" == f"{cli['score']:.4f}"
    assert ours.signatures["bleu_tok_split"].endswith(cli["signature"])


def test_references_against_themselves_give_100() -> None:
    scores = score_corpus(REFS, REFS)
    for key in METRIC_KEYS:
        assert getattr(scores, key) == pytest.approx(100.0), key


# ----- ATAT compound split (get_ende_bleu.sh step 3) ------------------------------------------------
# Expected values are worked out by hand from Perl's semantics for ``perl -ple
# 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'``: the line is UTF-8 bytes, \S is any byte but ASCII
# whitespace, and /g takes non-overlapping matches left to right, so a byte consumed as the right
# side of one match cannot be the left side of the next. "old:" gives what the former lookaround
# regex (?<=\w)-(?=\w), which split every hyphen between word characters, made of the case.
@pytest.mark.parametrize(("text", "expected"), [
    # old: a ##AT##-##AT## b ##AT##-##AT## c. "a-b" matches and consumes "b"; the scan resumes at
    # "-c", where no byte is left before the "-", so the second hyphen stays.
    ("a-b-c", "a ##AT##-##AT## b-c"),
    # old: Howl ##AT##-##AT## O ##AT##-##AT## Scream. Same as a-b-c: "l-O" consumes "O".
    ("Howl-O-Scream", "Howl ##AT##-##AT## O-Scream"),
    # Five parts: "a-b" consumes b, "c-d" matches, consumes d, "-e" is left.
    ("a-b-c-d-e", "a ##AT##-##AT## b-c ##AT##-##AT## d-e"),
    # Longer middle parts leave a free byte before the next hyphen: both split (old: the same).
    ("E-Mail-Adresse", "E ##AT##-##AT## Mail ##AT##-##AT## Adresse"),
    ("B 33-Fußgängerampel", "B 33 ##AT##-##AT## Fußgängerampel"),
    # tokenizer.perl -l de makes "1.-3 ." of "1.-3." (see test_tokenised_chain); "." is \S, so
    # ".-3" matches. old: unchanged, "." is not \w.
    ("1.-3 .", "1. ##AT##-##AT## 3 ."),
    # The raw "1.-3." alone: ".-3" matches, the final "." is untouched.
    ("1.-3.", "1. ##AT##-##AT## 3."),
    # The raw "US-$" alone: "S-$" matches ("$" is \S). old: unchanged, "$" is not \w.
    ("US-$", "US ##AT##-##AT## $"),
    # tokenizer.perl's "US- $": a space follows the hyphen, nothing to split (old: the same).
    ("US- $", "US- $"),
    # old: x--y. "x--" matches with the second "-" as the right side, consuming it; "y" remains.
    ("x--y", "x ##AT##-##AT## -y"),
    # Non-ASCII: Öl is C3 96 6C; "l-P" matches as before, the two bytes of Ö pass through.
    ("Öl-Preis", "Öl ##AT##-##AT## Preis"),
    ("Öl-Ära", "Öl ##AT##-##AT## Ära"),  # right side is the first byte of Ä (C3), bytes kept whole
    # Bytes, not characters: "A-" + C3 consumes only the first byte of Ö; its second byte 96 is
    # \S and starts the next match "\x96-B". With `use utf8` (characters) it would be
    # "A ##AT##-##AT## Ö-B", like A-O-B below. old: the same as ours here (Ö is \w).
    ("A-Ö-B", "A ##AT##-##AT## Ö ##AT##-##AT## B"),
    ("A-O-B", "A ##AT##-##AT## O-B"),
    # A no-break space U+00A0 is C2 A0; A0 is not ASCII whitespace, so "\xa0-b" matches and the
    # space stays glued to "a". old: unchanged (NBSP is not \w).
    ("a\u00a0-b", "a\u00a0 ##AT##-##AT## b"),
    ("a - b", "a - b"),                  # a free-standing dash: whitespace on both sides
    ("Nord- und Süd", "Nord- und Süd"),  # suspended hyphen: a space on its right
    ("-3 Grad", "-3 Grad"),              # sign at the start: nothing on its left
    ("", ""),
])
def test_compound_split_has_perl_byte_semantics(text: str, expected: str) -> None:
    assert compound_split(text) == expected


_PERL_CASES = ["a-b-c", "Howl-O-Scream", "a-b-c-d-e", "1.-3 .", "1.-3.", "US-$", "x--y", "x---y", "Öl-Preis",
               "A-Ö-B", "a\u00a0-b", "—-–", "a\t-b", "a\x0b-b", "Nord- und Süd", "ß-ß-ß-ß", "a -b- c"]


@pytest.mark.skipif(shutil.which("perl") is None, reason="perl is not installed")
def test_compound_split_equals_the_perl_one_liner() -> None:
    # The very command of get_ende_bleu.sh, where perl is available: an independent check.
    data = "".join(f"{case}\n" for case in _PERL_CASES).encode("utf-8")
    out = subprocess.run(["perl", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"], input=data,
                         capture_output=True, check=True, timeout=60).stdout
    assert out.decode("utf-8").split("\n")[:-1] == [compound_split(case) for case in _PERL_CASES]


# ----- replace-unicode-punctuation.perl (step 1) --------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    # “ and ” become ", but the German low quote „ is not in the script's list and stays.
    ("„Ja“, sagte er.", "„Ja\", sagte er."),
    ("”Ja”", "\"Ja\""),
    ("Und dann…", "Und dann..."),                 # … → ...
    ("1，2", "1,2"),                              # full-width comma → ,
    ("Ende。  Anfang", "Ende. Anfang"),           # 。 and the spaces after it → ". "
    ("Ende．Anfang", "Ende. Anfang"),             # full-width full stop likewise
    ("（５０％）", "(50%)"),                       # full-width brackets, digits, percent
    ("Nr. １", "Nr. \""),                          # the script maps full-width 1 to a quote
    ("it’s", "it's"),                             # ’ → '
    ("‚ja‘ «nein» – vielleicht", "‚ja‘ «nein» – vielleicht"),  # not in the list: unchanged
    ("", ""),
])
def test_replace_unicode_punctuation(text: str, expected: str) -> None:
    assert replace_unicode_punctuation(text) == expected


def test_unicode_punctuation_table_follows_the_script() -> None:
    # 36 substitutions, first and last as in the script; the two full stops take trailing spaces.
    assert len(UNICODE_PUNCTUATION) == 36
    assert UNICODE_PUNCTUATION[0] == ("，", ",") and UNICODE_PUNCTUATION[-1] == ("％", "%")
    assert [p for p, _ in UNICODE_PUNCTUATION if p.endswith(" *")] == ["。 *", "． *"]


# ----- the whole chain: replace-unicode, tokenizer.perl -l de, ATAT -------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    # tokenizer.perl -l de: "." and "-" are not separated; the last word "1.-3." ends in "." and is
    # the last word, so it becomes "1.-3 ." ; ATAT then splits ".-3".
    ("1.-3.", "1. ##AT##-##AT## 3 ."),
    # Mid-sentence the same: "1.-3" is not a non-breaking prefix and "Mai" is not lower case.
    ("vom 1.-3. Mai", "vom 1. ##AT##-##AT## 3 . Mai"),
    # tokenizer.perl separates "$" (not alphanumeric): "US- $"; ATAT finds no byte after the "-".
    ("US-$", "US- $"),
    # the tokeniser folds all whitespace, NBSP included, to a space first: "a -b", nothing to split.
    ("a\u00a0-b", "a -b"),
    ("Howl-O-Scream", "Howl ##AT##-##AT## O-Scream"),
    ("Öl-Preis", "Öl ##AT##-##AT## Preis"),
    # Escaping on (tokenizer.perl's default): & → &amp;, " → &quot; ; no -a, so "Test-Fall" is
    # left whole by the tokeniser and split only by ATAT.
    ('Ein "Test-Fall" & mehr.', "Ein &quot; Test ##AT##-##AT## Fall &quot; &amp; mehr ."),
    ("A & B", "A &amp; B"),
    ("Er sagt: ‚nein’…", "Er sagt : ‚ nein &apos; ..."),  # ’ → ' → &apos; ; … → ... kept together
    # „ survives step 1 and is separated by the tokeniser; “ became " and then &quot;.
    ("„Das ist gut“, sagte er.", "„ Das ist gut &quot; , sagte er ."),
    ("", ""),
])
def test_tokenised_chain(text: str, expected: str) -> None:
    assert tokenize_for_paper_bleu([text]) == [expected]


# ----- end to end, against an independent multi-bleu -----------------------------------------------
def _multi_bleu_stats(hyps: list[str], refs: list[str]) -> tuple[list[int], list[int], int, int]:
    """multi-bleu.perl's counts for one reference: clipped correct n-grams, totals, lengths."""
    correct, total, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hyps, refs, strict=True):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            h_grams = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            r_grams = Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            total[n - 1] += sum(h_grams.values())
            correct[n - 1] += sum(min(count, r_grams[gram]) for gram, count in h_grams.items())
    return correct, total, hyp_len, ref_len


def _multi_bleu(hyps: list[str], refs: list[str]) -> float:
    """multi-bleu.perl's BLEU (x100): BP exp(1 - r/c) when c < r, any zero precision gives 0."""
    correct, total, hyp_len, ref_len = _multi_bleu_stats(hyps, refs)
    if 0 in correct:
        return 0.0
    bp = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * bp * math.exp(sum(math.log(c / t) for c, t in zip(correct, total, strict=True)) / 4)


E2E_HYPS = ["Der Vitamin-B-Mangel war vom 1.-3. Mai.", '"Das ist gut", sagte er.']
E2E_REFS = ["Der Vitamin-B-Mangel dauerte vom 1.-3. Mai.", "„Das ist gut“, sagte er."]
# get_ende_bleu.sh by hand (see test_tokenised_chain for each rule): 12 and 9 tokens a side.
E2E_HYPS_TOK = ["Der Vitamin ##AT##-##AT## B-Mangel war vom 1. ##AT##-##AT## 3 . Mai .",
                "&quot; Das ist gut &quot; , sagte er ."]
E2E_REFS_TOK = ["Der Vitamin ##AT##-##AT## B-Mangel dauerte vom 1. ##AT##-##AT## 3 . Mai .",
                "„ Das ist gut &quot; , sagte er ."]
# What the old code made of them (no unicode replacement, no escaping, (?<=\w)-(?=\w) split).
E2E_HYPS_OLD = ["Der Vitamin ##AT##-##AT## B ##AT##-##AT## Mangel war vom 1.-3 . Mai .",
                '" Das ist gut " , sagte er .']
E2E_REFS_OLD = ["Der Vitamin ##AT##-##AT## B ##AT##-##AT## Mangel dauerte vom 1.-3 . Mai .",
                "„ Das ist gut “ , sagte er ."]


def test_paper_bleu_end_to_end_equals_a_hand_count() -> None:
    assert tokenize_for_paper_bleu(E2E_HYPS) == E2E_HYPS_TOK
    assert tokenize_for_paper_bleu(E2E_REFS) == E2E_REFS_TOK
    # By hand. Line 1 differs in one token of 12 (war/dauerte, 5th): n-grams 12/11/10/9, of which
    # 1/2/3/4 contain it. Line 2 differs in the first of 9 (&quot;/„): 9/8/7/6 n-grams, 1 each
    # contains it (the hypothesis' two &quot; are clipped to the reference's one). Lengths 21 = 21,
    # so BP = 1.
    correct, total = [11 + 8, 9 + 7, 7 + 6, 5 + 5], [12 + 9, 11 + 8, 10 + 7, 9 + 6]
    assert _multi_bleu_stats(E2E_HYPS_TOK, E2E_REFS_TOK) == (correct, total, 21, 21)
    expected = 100 * (19 * 16 * 13 * 10 / (21 * 19 * 17 * 15)) ** 0.25  # 78.945...
    assert _multi_bleu(E2E_HYPS_TOK, E2E_REFS_TOK) == pytest.approx(expected, abs=1e-9)
    assert score_corpus(E2E_HYPS, E2E_REFS).bleu_tok_split == pytest.approx(expected, abs=1e-9)
    # The old tokenisation scores these two lines differently (the fix changes the figure).
    assert abs(_multi_bleu(E2E_HYPS_OLD, E2E_REFS_OLD) - expected) > 1.0


def test_multi_bleu_zero_precision_and_brevity_rules() -> None:
    # No 4-gram in common: multi-bleu gives 0 (no smoothing), and so does the scorer.
    assert score_corpus(["a b c d"], ["a b c e"]).bleu_tok_split == 0.0
    # Short hypothesis: 4 of 5 reference tokens, all n-grams correct, BP = exp(1 - 5/4).
    score = score_corpus(["a b c d"], ["a b c d e"]).bleu_tok_split
    assert score == pytest.approx(100 * math.exp(1 - 5 / 4), abs=1e-9)
    assert score == pytest.approx(_multi_bleu(["a b c d"], ["a b c d e"]), abs=1e-9)


def test_signature_names_the_steps() -> None:
    sig = score_corpus(["a b"], ["a b"]).signatures[TOKENIZED_METRIC]
    assert sig.startswith("t2t-get_ende_bleu:replace-unicode-punct+moses-tok-de+atat|")
    assert "tok:none" in sig and "smooth:none" in sig


def test_line_count_mismatch_names_both_files(files: tuple[Path, Path], tmp_path: Path) -> None:
    hyp, ref = files
    write_lines(hyp, HYPS[:-1])
    with pytest.raises(DataError, match=rf"{hyp}.*{len(HYPS) - 1} lines.*{ref}.*{len(REFS)}"):
        score_files(hyp, ref)
    with pytest.raises(DataError, match="6 hypotheses but 7 references"):
        score_corpus(HYPS[:-1], REFS)

"""BLEU scoring: sacreBLEU figures equal the sacrebleu command line's; the paper's tokenized BLEU."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.core.errors import DataError
from pipeline.core.textio import write_lines
from pipeline.inference.scoring import METRIC_KEYS, compound_split, score_corpus, score_files, tokenize_for_paper_bleu

REFS = [
    "Gutach: Noch mehr Sicherheit für Fußgänger",
    "Sie stehen keine 100 Meter voneinander entfernt: Am Dienstag ist in Gutach die neue B 33-Fußgängerampel "
    "in Betrieb genommen worden.",
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


def test_figures_equal_the_sacrebleu_command_line(files: tuple[Path, Path]) -> None:
    hyp, ref = files
    ours = score_files(hyp, ref)
    assert ours["sentences"] == len(REFS)
    for key, args in CLI_ARGS.items():
        cli = _cli(ref, hyp, args)
        assert f"{ours[key]:.4f}" == f"{cli['score']:.4f}", key
        assert ours["signatures"][key] == cli["signature"], key
    assert 0.0 < ours["bleu"] < 100.0


def test_paper_bleu_equals_the_command_line_on_moses_compound_split_files(files: tuple[Path, Path],
                                                                           tmp_path: Path) -> None:
    hyp, ref = files
    hyp_tok, ref_tok = tmp_path / "hyp.tok", tmp_path / "ref.tok"
    write_lines(hyp_tok, tokenize_for_paper_bleu(HYPS))
    write_lines(ref_tok, tokenize_for_paper_bleu(REFS))
    cli = _cli(ref_tok, hyp_tok, ["-m", "bleu", "-tok", "none", "-s", "none", "--force"])
    ours = score_files(hyp, ref)
    assert f"{ours['bleu_tok_split']:.4f}" == f"{cli['score']:.4f}"
    assert ours["signatures"]["bleu_tok_split"].endswith(cli["signature"])


def test_references_against_themselves_give_100() -> None:
    scores = score_corpus(REFS, REFS)
    for key in METRIC_KEYS:
        assert scores[key] == pytest.approx(100.0), key


@pytest.mark.parametrize(("text", "expected"), [
    ("E-Mail-Adresse", "E ##AT##-##AT## Mail ##AT##-##AT## Adresse"),
    ("B 33-Fußgängerampel", "B 33 ##AT##-##AT## Fußgängerampel"),
    ("a - b", "a - b"),            # a free-standing dash is punctuation, not a compound
    ("Nord- und Süd", "Nord- und Süd"),  # suspended hyphen: nothing on its right
    ("-3 Grad", "-3 Grad"),        # sign, nothing on its left
    ("x--y", "x--y"),              # double dash is not between word characters
    ("Öl-Ära", "Öl ##AT##-##AT## Ära"),  # Unicode letters count as word characters
    ("", ""),
])
def test_compound_split(text: str, expected: str) -> None:
    assert compound_split(text) == expected


def test_moses_tokenisation_does_not_escape_and_splits_compounds() -> None:
    (line,) = tokenize_for_paper_bleu(['Ein "Test-Fall" & mehr.'])
    assert line == 'Ein " Test ##AT##-##AT## Fall " & mehr .'


def test_line_count_mismatch_names_both_files(files: tuple[Path, Path], tmp_path: Path) -> None:
    hyp, ref = files
    write_lines(hyp, HYPS[:-1])
    with pytest.raises(DataError, match=rf"{hyp}.*{len(HYPS) - 1} lines.*{ref}.*{len(REFS)}"):
        score_files(hyp, ref)
    with pytest.raises(DataError, match="6 hypotheses but 7 references"):
        score_corpus(HYPS[:-1], REFS)

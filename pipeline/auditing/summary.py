"""The audit's summary: the headline test BLEU beside the reference that fits the test set (:data:`TEST_SETS`),
the counts per kind of item, and the warnings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypedDict

from pipeline.auditing.items import KINDS, VERDICTS, Item
from pipeline.auditing.paper_rows import PAPER, PaperRow
from pipeline.core.details import SetFigures


@dataclass(frozen=True)
class HeadlineReference:
    """A dataset's test set and its published reference (None: ``why`` none is comparable)."""

    name: str
    sentences: int
    reference: float | None = None
    source: str = ""
    why: str = ""


TEST_SETS: dict[str, HeadlineReference] = {
    "wmt14": HeadlineReference("WMT14 newstest2014", PAPER["test_sentences"], PAPER["bleu_en_de"],
                               "Vaswani et al. 2017, Table 2 (base)"),
    "multi30k": HeadlineReference("Multi30k test_2016_flickr", 1000, why=(
        "no comparable published figure: published Multi30k EN-DE results mostly lowercase or tokenise differently "
        "from sacreBLEU 13a on cased text, so none is set beside this one")),
}


class Headline(TypedDict):
    """The test BLEU (None: not measured) beside the ``reference`` that fits the test set."""

    text: str
    test_set: str
    reference: float | None
    comparable: bool
    bleu: float | None
    bleu_tok_split: float | None


def headline(dataset: str | None, test: SetFigures, row: PaperRow) -> Headline:
    """The test BLEU beside the reference that fits the test set (``test`` empty when not evaluated yet); on WMT14,
    the paper's ``row`` (:func:`pipeline.auditing.paper.paper_row`)."""
    spec = TEST_SETS.get(str(dataset))
    if dataset == "wmt14":
        spec = replace(spec, reference=row["bleu_en_de"], source=f"Vaswani et al. 2017, Table 2 ({row['size']})")
    name = spec.name if spec else f"the {dataset} test set"
    out = Headline(text="Test BLEU: not measured (no evaluate.details.json yet: run `dvc repro evaluate`).",
                   test_set=name, reference=None, comparable=False, bleu=None, bleu_tok_split=None)
    if test.bleu is None:
        return out
    sacre, tok, n = float(test.bleu), test.bleu_tok_split, test.sentences
    out.update(bleu=sacre, bleu_tok_split=tok)
    size = f"{n:,} sentences" if n is not None else "size not recorded"
    tok_text = f"{tok:.2f}" if tok is not None else "not measured"
    if spec is None:
        text = (f"Test BLEU {sacre:.2f} (sacreBLEU 13a) on {name} ({size}): no published reference applies; the "
                f"paper's {row['bleu_en_de']} is on WMT14 newstest2014.")
    elif spec.reference is None:
        text = (f"Test BLEU {sacre:.2f} (sacreBLEU 13a, cased; {tok_text} on the paper's tok+split metric) on "
                f"{name} ({size}): {spec.why}. The paper's {row['bleu_en_de']} is on WMT14 newstest2014 "
                "and does not apply.")
    elif n != spec.sentences or tok is None:
        text = (f"Test BLEU {tok_text} on the paper's metric (tok+split), {sacre:.2f} sacreBLEU 13a, on {name} "
                f"({size}, the full set has {spec.sentences:,}): not comparable with the paper's "
                f"{spec.reference}.")
    else:
        low, high = row["sacrebleu_equivalent"]
        out.update(reference=spec.reference, comparable=True)
        text = (f"Test BLEU {tok:.2f} on the paper's metric (tok+split) on {name} ({size}) vs the paper's "
                f"{spec.reference} ({spec.source}): {tok - spec.reference:+.2f}; sacreBLEU 13a "
                f"{sacre:.2f} (the paper's figure is about {low}-{high} there).")
    out["text"] = text
    return out


class Summary(TypedDict):
    """Verdicts counted per kind of item (:func:`counts`), the warnings and the deviation topics."""

    paper: dict[str, int]
    reference: dict[str, int]
    checks: dict[str, int]
    warnings: int
    deviation_topics: int


def counts(items: list[Item]) -> dict[str, dict[str, int]]:
    """Verdicts counted per kind (:data:`pipeline.auditing.items.KINDS`): a check never adds a match."""
    return {kind: {v: sum(1 for i in items if i["kind"] == kind and i["verdict"] == v) for v in VERDICTS}
            for kind in KINDS}


def warnings(items: list[Item]) -> list[str]:
    """One line per check that fired (``warning``: its note) or failed (``deviates``: what differs)."""
    return [f"{i['item']}: {i['note'] if i['verdict'] == 'warning' else i['deviation']}" for i in items
            if i["kind"] == "check" and i["verdict"] in ("warning", "deviates")]


def counts_line(summary: Summary) -> str:
    """The counts as one sentence: paper items, reference-implementation items, run checks."""
    paper, ref, checks = summary["paper"], summary["reference"], summary["checks"]
    return (f"Against the paper: {paper['matches']} match, {paper['deviates']} deviate, {paper['not measured']} "
            f"not measured ({paper['informational']} informational). Where the paper is silent, against its "
            f"reference implementations: {ref['matches']} match, {ref['deviates']} deviate. Run checks (sanity, "
            f"replay, lineage), counted apart: {checks['matches']} pass, {checks['warning']} warning(s), "
            f"{checks['deviates']} fail, {checks['not measured']} not measured.")

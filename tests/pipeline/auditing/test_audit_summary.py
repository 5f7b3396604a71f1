"""The audit's first screen: the headline BLEU beside the reference that fits the test set, warnings, and the
deviations ranked by expected effect on BLEU, each listed once; matches counted for the paper's items only."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pipeline.auditing.ranking import HEADLINE_ITEMS, TOPIC_OF, TOPICS
from pipeline.auditing.render import render_markdown
from pipeline.auditing.report import build_audit, tracking_metrics
from pipeline.auditing.settings import PAPER_SETTINGS
from pipeline.project.profiles import merged_profile
from tests.helpers.audit_world import demo_like_metrics, missing_repository_files, synthetic_inputs
from tests.helpers.paths import REPO

SUMMARY_LINES = 30


def _demo(metrics: dict[str, Any] | None = None, **params: Any) -> tuple[dict[str, Any], str, Any]:
    """The audit of a demo-like run (demo profile, stage details shaped like ``make demo``'s) and its markdown."""
    data = merged_profile("demo", REPO)
    for section, values in params.items():
        data[section] = {**data[section], **values}
    inp = synthetic_inputs(data, metrics=demo_like_metrics() if metrics is None else metrics,
                           paper_profile=merged_profile("paper", REPO))
    report = build_audit(inp)
    return report, render_markdown(report), inp


def _items(report: dict[str, Any]) -> list[dict[str, Any]]:
    return report["configuration"] + report["measured"] + report["replay"].get("items", [])


def test_summary_fits_the_first_30_lines_of_a_demo_like_run() -> None:
    report, md, _ = _demo({**demo_like_metrics(), "average": {"steps": [140, 280, 420, 560, 700]}})
    summary = md.split("## Deviations in full")[0].splitlines()
    shown = sum(max(1, -(-len(line) // 120)) for line in summary)  # as a 120-column terminal wraps them
    assert shown <= SUMMARY_LINES, shown
    head = md.splitlines()[:SUMMARY_LINES]
    assert head[2] == report["headline"]["text"] and head[2].startswith("Test BLEU 27.94 (sacreBLEU 13a")
    assert head[4].startswith("Against the paper: ")
    for n, warning in enumerate(report["warnings"], start=1):  # the span warning fires: 80% of training averaged
        assert f"{n}. {warning}" in head
    assert any("the averaged checkpoints span 80.0% of training" in w for w in report["warnings"])
    top = [t["topic"] for t in report["deviation_topics"][:3]]
    assert top == ["Training data", "Model size", "Training length"]
    for n, topic in enumerate(report["deviation_topics"][:3], start=1):
        assert any(line.startswith(f"- **{n}. {topic['topic']}**: ") for line in head), topic["topic"]
    assert "the first three matter most" in "\n".join(head)


def test_no_deviation_is_listed_twice() -> None:
    """In full once (Deviations in full); the summary's line of its topic may show the start of it, cut."""
    report, md, _ = _demo()
    summary, full = md.split("## Deviations in full")
    deviating = [i for i in _items(report) if i["verdict"] == "deviates"]
    assert len(deviating) > 20
    for i in deviating:
        assert full.count(i["deviation"]) == 1 and summary.count(i["deviation"]) <= 1, i["item"]
        assert not re.search(rf"^\| {re.escape(i['item'])} \|", md, flags=re.M), i["item"]  # no table row either
    assert "**deviates**" not in md and "## Verdicts" not in md
    topics = [t["topic"] for t in report["deviation_topics"]]
    assert len(topics) == len(set(topics)) == len(report["deviations"])
    assert sum(len(t["items"]) for t in report["deviation_topics"]) == len(
        [i for i in deviating if i["item"] not in HEADLINE_ITEMS])
    assert "paper setting: deviates" not in md  # the profile list leaves the judged keys to the verdicts


def test_every_paper_or_reference_item_has_a_topic() -> None:
    report, _, _ = _demo()
    names = {s.name for s in PAPER_SETTINGS} | {i["item"] for i in report["measured"] if i["kind"] != "check"}
    informational = {"World size", "Forward passes per step", "Valid set, averaged model"}
    assert names - set(TOPIC_OF) - set(HEADLINE_ITEMS) == informational
    assert len(TOPIC_OF) == sum(len(t.items) for t in TOPICS)  # no item in two topics


def test_matches_count_only_the_papers_items() -> None:
    report, _, inp = _demo()
    items = _items(report)
    for kind, key in (("paper", "paper"), ("reference", "reference"), ("check", "checks")):
        for verdict in ("matches", "deviates", "not measured"):
            assert report["summary"][key][verdict] == sum(1 for i in items if i["kind"] == kind
                                                          and i["verdict"] == verdict)
    for i in items:
        if i["kind"] == "paper":
            assert "§" in i["source"] or "Table" in i["source"], i  # cites the paper
        if i["kind"] == "reference":
            assert i["source"].startswith("paper silent") or "paper silent" in i["source"], i
    checks = {i["item"] for i in items if i["kind"] == "check"}
    assert {"Averaging span", "Averaged vs newest checkpoint, valid BLEU", "Lineage consistency"} <= checks
    numbers = tracking_metrics(report, inp)
    paper = report["summary"]["paper"]
    assert (numbers["matches"], numbers["deviates"], numbers["not_measured"]) == (
        paper["matches"], paper["deviates"], paper["not measured"])
    assert numbers["checks_passed"] == report["summary"]["checks"]["matches"] >= 2
    assert numbers["warnings"] == len(report["warnings"]) and numbers["deviation_topics"] == len(report["deviations"])
    # a passing check adds nothing to the paper's matches
    more = build_audit(inp.__class__(**{**inp.__dict__, "replay": {"items": [
        {"item": "Replay: x", "kind": "check", "paper": "-", "run": "ok", "verdict": "matches", "deviation": "",
         "note": "", "source": "pipeline/auditing/replay.py"}]}}))
    assert more["summary"]["paper"] == paper and more["summary"]["checks"]["matches"] == numbers["checks_passed"] + 1


def test_multi30k_is_compared_with_no_published_figure() -> None:
    report, md, _ = _demo()
    head = report["headline"]
    assert (head["test_set"], head["reference"], head["comparable"]) == ("Multi30k test_2016_flickr", None, False)
    assert "no comparable published figure" in head["text"] and "does not apply" in head["text"]
    numbers = set(re.findall(r"\d+\.\d+", head["text"]))
    assert numbers == {"27.94", "27.96", "27.3"}  # the run's figures, the paper's (named as not applying)
    for name in HEADLINE_ITEMS:
        item = next(i for i in report["measured"] if i["item"] == name)
        assert item["verdict"] == "informational" and "multi30k test set, not newstest2014" in item["note"]
    assert "27.3" not in "\n".join(report["deviations"])
    assert "this run was tested on Multi30k test_2016_flickr (see the headline)" in md


@pytest.mark.parametrize(("tok", "sentences", "expected"), [
    (26.5, 3003, "Test BLEU 26.50 on the paper's metric (tok+split) on WMT14 newstest2014 (3,003 sentences) vs the "
                 "paper's 27.3 (Vaswani et al. 2017, Table 2 (base)): -0.80; sacreBLEU 13a 25.50"),
    (27.5, 3000, "not comparable with the paper's 27.3"),
])
def test_wmt14_headline_sets_the_papers_27_3_beside_the_full_newstest2014(tok: float, sentences: int,
                                                                        expected: str) -> None:
    metrics = demo_like_metrics()
    metrics["evaluate"]["test"].update(bleu=tok - 1.0, bleu_tok_split=tok, sentences=sentences)
    report, md, _ = _demo(metrics, download={"dataset": "wmt14"})
    assert expected in report["headline"]["text"] and md.splitlines()[2] == report["headline"]["text"]
    assert report["headline"]["comparable"] == (sentences == 3003)
    assert not any(name in t["items"] for t in report["deviation_topics"] for name in HEADLINE_ITEMS)
    if sentences == 3003:  # the result below 27.3 is the headline, not a line of the deviation list
        item = next(i for i in report["measured"] if i["item"] == HEADLINE_ITEMS[0])
        assert item["verdict"] == "deviates" and md.count(item["deviation"]) == 0


def test_headline_before_anything_was_evaluated() -> None:
    metrics = {k: v for k, v in demo_like_metrics().items() if k != "evaluate"}
    report, md, _ = _demo(metrics)
    assert md.splitlines()[2] == "Test BLEU: not measured (no evaluate.details.json yet: run `dvc repro evaluate`)."


def test_the_report_names_only_files_the_repository_has() -> None:
    _, md, _ = _demo()
    assert "pipeline/auditing/ranking.py" in md
    assert missing_repository_files(md) == []
    assert missing_repository_files("see pipeline/audit_replay.py") == ["pipeline/audit_replay.py"]

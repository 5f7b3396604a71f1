"""The paper's row: a run of the ``paper-big`` profile, or of any model with d_model >= 1024, is set beside the
Transformer (big) (Table 2: 28.4; Table 3 row big; §5.2; §6.1), every other run beside the base row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline import audit
from pipeline.auditing.paper_rows import PAPER, PAPER_BIG, paper_row
from pipeline.auditing.render import render_markdown
from pipeline.auditing.report import build_audit
from pipeline.core.config import params_from_dict
from pipeline.project.profiles import merged_profile
from tests.helpers.audit_world import build_audit_world, profile_params, synthetic_inputs
from tests.helpers.paths import REPO

#: fairseq's length filter and ratio, at its numbers but counted in words, not BPE tokens: deviations of every profile.
WORDS_NOT_BPE = {"Training-pair length filter", "Training-pair length ratio"}
TINY = {"d_model": 64, "n_heads": 4, "d_ff": 128}
#: paper-big's settings but its sizes: dimensions, lengths, steps (100, a checkpoint each, the last 20 averaged).
SIZES = {"model": {"d_model": 32, "n_heads": 2, "d_ff": 64, "n_layers": 1, "max_positions": 128},
         "encode": {"max_len": 64}, "evaluate": {"max_len_b": 10, "max_tokens": 512},
         "train": {"tokens_per_step": 1024, "warmup_steps": 5, "max_steps": 100, "save_every_steps": 1,
                   "valid_every_steps": 50, "log_every_steps": 10}}


def _metrics(steps: list[int]) -> dict[str, Any]:
    """A finished WMT14 run on 8 GPUs: ~25k target tokens per step, the full newstest2013/2014, beam 4 and α 0.6."""
    final = steps[-1]
    figures = {"bleu": 25.5, "bleu_tok_split": 26.6, "ppl": 4.40, "sentences": 3000}
    return {"train": {"step": final, "tokens_seen": final * 25_000, "world_size": 8, "tokens_per_step_mean": 25_000.0},
            "average": {"steps": steps, "parameters": 1_000_000},
            "evaluate": {"chosen": {"beam": 4, "alpha": 0.6, "chosen_on": "valid"}, "valid": figures,
                         "valid_newest": {**figures, "step": final},
                         "test": {"bleu": 27.3, "bleu_tok_split": 28.6, "sentences": 3003}}}


def _audit(profile: str, steps: list[int], **model: int) -> tuple[dict[str, Any], dict[str, dict], str]:
    params = merged_profile(profile, REPO)
    params["model"].update(model)
    report = build_audit(synthetic_inputs(params, metrics=_metrics(steps)))
    return report, {i["item"]: i for i in report["configuration"] + report["measured"]}, render_markdown(report)


def test_a_tiny_paper_big_run_is_compared_with_the_big_rows_and_its_dimensions_deviate() -> None:
    report, items, md = _audit("paper-big", [288_600 + 600 * i for i in range(20)], **TINY)
    assert report["paper"] is PAPER_BIG
    assert md.splitlines()[0] == ("# Replication audit: profile paper-big (dataset wmt14), compared with Transformer "
                                  "(big), Tables 2 and 3")
    assert report["headline"]["reference"] == 28.4 and "vs the paper's 28.4 (Vaswani et al. 2017, Table 2 (big)): " \
        "+0.20; sacreBLEU 13a 27.30 (the paper's figure is about 27.0-27.7 there)" in report["headline"]["text"]
    assert items["BLEU, paper's method (tok+split), test"]["paper"] == "28.4"
    assert items["BLEU, sacreBLEU 13a, test"]["paper"] == "~27.0-27.7 (= 28.4 on the paper's metric)"
    bleu, ppl = (items[f"{what}, valid, newest checkpoint"] for what in ("BLEU, paper's method (tok+split)",
                                                                          "Perplexity per BPE token"))
    assert bleu["paper"].startswith("26.4 (Table 3 big") and ppl["paper"].startswith("4.33 per wordpiece (Table 3 big")
    assert bleu["verdict"] == ppl["verdict"] == "matches"
    assert (items["Parameters"]["paper"], items["Parameters"]["deviation"]) == ("213M (Table 3)",
                                                                                "1.0M parameters (paper: 213M)")
    assert (items["Steps trained"]["paper"], items["Steps trained"]["verdict"]) == ("300,000", "matches")
    assert items["Target tokens trained"]["paper"] == "~7.5B (300k steps x ~25k)"
    assert (items["Training time"]["paper"], items["GPU-hours"]["paper"]) == ("84 h", "672 P100-hours (8 x 84 h)")
    span = items["Averaging span"]
    assert span["paper"] == PAPER_BIG["averaging"] and span["verdict"] == "matches"
    assert "is 190 of 5040 minutes before the end (3.8%), 200 counting" in span["note"]
    judged = {i["item"]: (i["paper"], i["verdict"]) for i in report["configuration"]}
    assert judged["Residual dropout P_drop"] == ("0.3 (EN-DE; 0.1 for EN-FR)", "matches")
    assert judged["Checkpoints averaged"] == ("last 20", "matches")
    assert judged["Checkpoint interval"][1] == judged["Training steps"][1] == "matches"
    deviating = {name for name, (_, verdict) in judged.items() if verdict == "deviates"}
    assert deviating == {"d_model", "d_ff", "Attention heads h", "d_k = d_v", *WORDS_NOT_BPE}
    assert any("model.d_model = 64 (paper: 1024)" in line for line in report["deviations"])
    assert report["warnings"] == []
    gap = report["bleu_gap"]["explanation"]  # the gap's text quotes the big row, not the base's 27.3
    assert "The paper's 28.4 was computed" in gap and "28.4 corresponds to about 27.0-27.7 sacreBLEU 13a" in gap
    assert "27.3" not in gap and "25.9" not in gap and gap in md
    assert "s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g" in gap


def test_a_base_run_is_still_compared_with_the_base_rows() -> None:
    report, items, md = _audit("paper", [94_000, 95_500, 97_000, 98_500, 100_000])
    assert report["paper"] is PAPER and md.splitlines()[0].endswith("compared with Transformer (base), Tables 2 and 3")
    assert report["headline"]["reference"] == 27.3 and "(Vaswani et al. 2017, Table 2 (base))" in \
        report["headline"]["text"]
    assert items["BLEU, paper's method (tok+split), valid, newest checkpoint"]["paper"].startswith("25.8 (Table 3 base")
    assert (items["Parameters"]["paper"], items["Steps trained"]["paper"]) == ("65M (Table 3)", "100,000")
    judged = {i["item"]: (i["paper"], i["verdict"]) for i in report["configuration"]}
    assert judged["Residual dropout P_drop"] == ("0.1", "matches") and judged["d_model"] == ("512", "matches")
    assert {name for name, (_, verdict) in judged.items() if verdict == "deviates"} == WORDS_NOT_BPE
    gap = report["bleu_gap"]["explanation"]
    assert "The paper's 27.3 was computed" in gap and "27.3 corresponds to about 25.9-26.6 sacreBLEU 13a" in gap


@pytest.mark.parametrize(("profile", "model", "row"), [
    ("paper", {}, PAPER), ("tiny", {}, PAPER), ("paper-big", TINY, PAPER_BIG), ("paper-big", {}, PAPER_BIG),
    ("paper", {"d_model": 1024, "n_heads": 16, "d_ff": 4096}, PAPER_BIG),
])
def test_the_row_follows_the_profile_or_the_model_width(profile: str, model: dict[str, int], row: dict) -> None:
    data = merged_profile(profile, REPO)
    data["model"].update(model)
    assert paper_row(params_from_dict(data)) is row


@pytest.mark.slow
def test_a_tiny_dimension_paper_big_run_through_the_real_stages_deviates_only_in_its_sizes(tmp_path: Path) -> None:
    """The stages (clean → ... → train → average → evaluate under tensor2tensor's beam rule) and the audit stage with
    every setting of paper-big but the sizes: set beside the big rows, only the sizes deviate (~10 s)."""
    root = build_audit_world(tmp_path, "paper-big", SIZES)
    _, params, params_file = profile_params("paper-big", root, SIZES)
    reports = root / "data" / "reports"
    audit.stage(params, params_file=params_file, lock_file=root / "dvc.lock", root=root,
                md_path=reports / "audit.md", json_path=reports / "audit.json")
    report = json.loads((reports / "audit.json").read_text(encoding="utf-8"))
    assert "not comparable with the paper's 28.4" in report["headline"]["text"]  # 4 test sentences
    assert (reports / "audit.md").read_text(encoding="utf-8").startswith(
        "# Replication audit: profile paper-big (dataset wmt14), compared with Transformer (big), Tables 2 and 3")
    averaged = json.loads((root / "data" / "metrics" / "average.details.json").read_text(encoding="utf-8"))
    assert averaged["steps"] == list(range(81, 101))
    items = {i["item"]: i for i in report["configuration"] + report["measured"]}
    assert {name: (items[name]["run"], items[name]["verdict"]) for name in (
        "Residual dropout P_drop", "Checkpoints averaged", "Beam search rule", "Beam size", "Length penalty α")} == {
        "Residual dropout P_drop": ("dropout 0.3", "matches"), "Checkpoints averaged": ("last_n 20", "matches"),
        "Beam search rule": ("beam_rule t2t", "matches"), "Beam size": ("beam_sizes [4]", "matches"),
        "Length penalty α": ("alphas [0.6]", "matches")}
    assert items["Averaging span"]["verdict"] == "matches" and items["Parameters"]["paper"] == "213M (Table 3)"
    assert (items["Steps trained"]["paper"], items["Steps trained"]["run"]) == ("300,000", "100")
    assert {i["item"] for i in report["configuration"] if i["verdict"] == "deviates"} == {
        "Maximum training length", "Layers N (encoder, decoder)", "d_model", "d_ff", "Attention heads h", "d_k = d_v",
        "Warmup steps", "Tokens per step", "Training steps", "Checkpoint interval", "Maximum output length",
        *WORDS_NOT_BPE}

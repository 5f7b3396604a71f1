"""The audit against the paper: every params key accounted for, and the measured items (tokens per step,
world size, averaging span, the newest checkpoint on newstest2013) from synthetic stage details."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import yaml

from pipeline.auditing.items import neutral
from pipeline.auditing.render import render_markdown
from pipeline.auditing.report import build_audit
from pipeline.auditing.settings import OPEN_KEYS, SETTING_KEYS
from pipeline.core.config import flatten
from pipeline.project.profiles import merged_profile
from tests.helpers.audit_world import synthetic_inputs
from tests.helpers.paths import REPO

JUDGED_SECTIONS = ("model", "train", "average", "evaluate")


def _params_yaml() -> dict[str, Any]:
    return flatten(yaml.safe_load((REPO / "profiles" / "paper.yaml").read_text(encoding="utf-8")))


def _audit(metrics: dict[str, Any], *, dataset: str = "wmt14") -> tuple[dict[str, Any], dict[str, dict]]:
    params = merged_profile("paper", REPO)
    params["download"]["dataset"] = dataset
    report = build_audit(synthetic_inputs(params, metrics=metrics))
    return report, {i["item"]: i for i in report["configuration"] + report["measured"]}


def _train(**fields: Any) -> dict[str, Any]:
    return {"step": 100_000, "tokens_seen": 2_500_000_000, "world_size": 8, **fields}


@pytest.mark.parametrize("key", sorted(k for k in _params_yaml() if k.split(".")[0] in JUDGED_SECTIONS))
def test_every_model_train_average_evaluate_key_is_compared_with_the_paper_or_neutral(key: str) -> None:
    """A key added to params.yaml must get a paper setting (settings.py) or be declared neutral (items.py)."""
    assert key in SETTING_KEYS or neutral(key), (
        f"params.yaml key {key} is neither compared with the paper (pipeline/auditing/settings.py PAPER_SETTINGS) "
        "nor in NEUTRAL_KEYS (pipeline/auditing/items.py)")


def test_every_params_key_is_judged_neutral_or_named_open() -> None:
    keys = set(_params_yaml())
    unaccounted = sorted(k for k in keys if k not in SETTING_KEYS and not neutral(k) and k not in OPEN_KEYS)
    assert unaccounted == []
    assert SETTING_KEYS <= keys and set(OPEN_KEYS) <= keys  # no setting for a key params.yaml lacks


def test_measured_tokens_per_step_deviate_even_when_the_params_say_25000() -> None:
    train = _train(tokens_seen=3_150_000_000, tokens_per_step_mean=31_500.0, tokens_per_step_std=1_200.0,
                   tokens_per_step_min=28_000, tokens_per_step_max=36_000, forwards_per_step_mean=1.0,
                   forwards_per_step_max=1)
    report, items = _audit({"train": train})
    assert items["Tokens per step"]["verdict"] == "matches"  # configured right ...
    measured = items["Target tokens per step"]  # ... measured wrong
    assert (measured["verdict"], measured["run"]) == ("deviates", "31,500")
    assert measured["deviation"] == "31,500 target tokens per step (paper: ~25,000; within 10% matches)"
    assert "std 1,200" in measured["note"] and "min-max 28,000-36,000" in measured["note"]
    assert "params train.tokens_per_step = 25,000" in measured["note"]
    assert "Batch size: 31,500 target tokens per step (paper: ~25,000; within 10% matches)" in report["deviations"]
    _, items = _audit({"train": _train(tokens_per_step_mean=24_800.0)})
    assert items["Target tokens per step"]["verdict"] == "matches"
    _, items = _audit({"train": _train(tokens_seen=2_000_000_000)})  # no mean recorded: tokens_seen / step
    assert items["Target tokens per step"]["run"] == "20,000" and "tokens_seen / step" in \
        items["Target tokens per step"]["note"]


def test_measured_source_tokens_per_step_are_judged_beside_the_target_ones() -> None:
    """§5.1: ~25,000 source and ~25,000 target tokens a step; the steps are filled by target tokens only."""
    _, items = _audit({"train": _train(tokens_per_step_mean=24_900.0, src_tokens_per_step_mean=21_000.0)})
    measured = items["Source tokens per step"]
    assert (measured["verdict"], measured["run"], measured["paper"]) == ("deviates", "21,000", "~25,000")
    assert measured["deviation"] == "21,000 source tokens per step (paper: ~25,000; within 10% matches)"
    assert items["Target tokens per step"]["verdict"] == "matches" and "length ratio" in measured["note"]
    _, items = _audit({"train": _train(src_tokens_per_step_mean=23_700.0)})
    assert items["Source tokens per step"]["verdict"] == "matches"
    _, items = _audit({"train": _train()})  # not recorded (a run before the count, or resumed from one)
    assert items["Source tokens per step"]["verdict"] == "not measured"


def test_the_minor_settings_come_last_read_from_the_code_biases_as_the_papers_tensor2tensor(monkeypatch) -> None:
    report, items = _audit({})
    assert [i["item"] for i in report["configuration"][-3:]] == [
        "Label smoothing spread", "LayerNorm ε", "Attention projection biases"]
    assert all(items[name]["verdict"] == "informational" and items[name]["kind"] == "reference"
               for name in ("Label smoothing spread", "LayerNorm ε"))
    assert items["Label smoothing spread"]["run"] == "ε/V to every class, the target included"
    assert items["LayerNorm ε"]["run"] == "1e-05" and items["LayerNorm ε"]["paper"] == "1e-6"
    # The tensor2tensor the paper ran (up to v1.2.9) had biases on q, k, v and output (conv1d's default), as ours
    biases = items["Attention projection biases"]
    assert (biases["verdict"], biases["kind"], biases["run"]) == ("matches", "reference", "q, k, v and output")
    assert "v1.2.9" in biases["source"] and "Attention projection biases" not in " ".join(report["deviations"])
    from model import Transformer

    class Unbiased(Transformer):  # what tensor2tensor v1.3.2 and later build
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for name, module in self.named_modules():
                if name.endswith("_proj"):
                    module.register_parameter("bias", None)

    with monkeypatch.context() as patched:
        patched.setattr("model.Transformer", Unbiased)
        _, unbiased = _audit({})
    assert (unbiased["Attention projection biases"]["verdict"], unbiased["Attention projection biases"]["run"]) == (
        "deviates", "none")

    def spread_to_the_others(logits, target, epsilon, ignore_index):  # fairseq's and tensor2tensor's spread
        logp = torch.log_softmax(logits, -1)
        nll = -logp.gather(-1, target[:, None]).sum()
        others = (-logp.sum(-1)).sum() - nll
        return (1 - epsilon) * nll + epsilon / (logits.shape[-1] - 1) * others, nll

    monkeypatch.setattr("model.label_smoothed_nll_loss", spread_to_the_others, raising=False)
    _, items = _audit({})
    assert items["Label smoothing spread"]["run"] == "not ε/V to every class"


def test_the_length_filter_and_ratio_deviate_at_fairseqs_numbers_counted_in_words_not_bpe_tokens() -> None:
    """fairseq's prepare-wmt14en2de.sh runs clean-corpus-n.perl 1 250 -ratio 1.5 on BPE text; clean counts
    whitespace words of the raw text (pipeline/data/filters.py): the same numbers on another unit."""
    report, items = _audit({})
    for name, run in (("Training-pair length filter", "min_words 1, max_words 250"),
                      ("Training-pair length ratio", "max_ratio 1.5")):
        assert (items[name]["verdict"], items[name]["run"]) == ("deviates", run), items[name]
        assert items[name]["deviation"].startswith(f"{run} in whitespace words of the raw text, not BPE tokens")
        assert "BPE tokens" in items[name]["paper"]
    line = next(d for d in report["deviations"] if d.startswith("Data filtering and lengths: "))
    assert "max_words 250 in whitespace words" in line and "max_ratio 1.5 in whitespace words" in line


def test_world_size_and_forward_passes_are_informational() -> None:
    _, items = _audit({"train": _train(world_size=1, tokens_per_step_mean=25_100.0, forwards_per_step_mean=3.5,
                                       forwards_per_step_max=4, device="cuda", device_name="NVIDIA H100")})
    assert (items["World size"]["verdict"], items["World size"]["run"]) == ("informational", "1 process(es)")
    assert items["Forward passes per step"]["run"] == "mean 3.50, max 4 (busiest rank)"
    assert items["Forward passes per step"]["verdict"] == "informational"
    assert items["Target tokens per step"]["verdict"] == "matches"  # the same batch on one GPU
    assert items["Hardware"]["verdict"] == "deviates"  # but not the paper's machines
    _, items = _audit({"train": {"step": 10}})
    assert items["Forward passes per step"]["verdict"] == "not measured"


@pytest.mark.parametrize(("steps", "run", "warning"), [
    ([94_000, 95_500, 97_000, 98_500, 100_000], "5 checkpoint(s), steps 94,000-100,000: the last 6.0% of training",
     ""),
    ([80_000, 85_000, 90_000, 95_000, 100_000], "5 checkpoint(s), steps 80,000-100,000: the last 20.0% of training",
     ""),  # the averaging rule params.yaml states: at most the last 20%
    ([75_000, 81_000, 87_000, 93_000, 100_000], "5 checkpoint(s), steps 75,000-100,000: the last 25.0% of training",
     "the averaged checkpoints span 25.0% of training (steps 75,000-100,000 of 100,000; the paper's span is about "
     "the last 6-7%; params.yaml's averaging rule allows 20%)"),
    ([22_000, 40_000, 60_000, 80_000, 100_000], "5 checkpoint(s), steps 22,000-100,000: the last 78.0% of training",
     "the averaged checkpoints span 78.0% of training"),
    ([97_000, 98_500, 100_000], "3 checkpoint(s), steps 97,000-100,000: the last 3.0% of training",
     "3 checkpoint(s) averaged (paper: 5)"),
    ([94_500, 96_000, 97_500, 99_000, 100_000], "5 checkpoint(s), steps 94,500-100,000: the last 5.5% of training",
     "the averaged checkpoints are unevenly spaced (gaps of 1,000, 1,500 steps; the paper's are 10 minutes apart): "
     "one is off the save grid and weighs like the others"),  # save_every_steps 1500 with max_steps 100,000
])
def test_averaging_span_is_a_sanity_check_that_warns_past_twenty_percent_or_off_the_grid(steps: list[int], run: str,
                                                                         warning: str) -> None:
    report, items = _audit({"train": _train(), "average": {"steps": steps}})
    span = items["Averaging span"]
    assert span["run"] == run and span["kind"] == "check" and "12-hour run" in span["paper"]
    assert span["verdict"] == ("warning" if warning else "matches")
    assert span["note"].startswith(warning if warning else "span = (final step - first averaged step)")
    assert report["warnings"] == ([f"Averaging span: {span['note']}"] if warning else [])
    assert report["summary"]["checks"]["warning"] == (1 if warning else 0)
    assert report["summary"]["paper"]["warning"] == 0  # a check never counts among the paper's items
    md = render_markdown(report)
    assert (f"## Warnings\n\n1. Averaging span: {span['note']}\n" in md) == bool(warning)


def test_averaging_span_names_a_training_that_went_on_after_the_average() -> None:
    _, items = _audit({"train": _train(step=110_000), "average": {"steps": [96_000, 97_000, 98_000, 99_000,
                                                                               100_000]}})
    assert items["Averaging span"]["run"].endswith("(training ended at step 110,000)")
    assert "last 12.7% of training" in items["Averaging span"]["run"]


def _evaluate(newest: dict[str, Any], averaged: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"valid": averaged or {"bleu": 25.0, "bleu_tok_split": 26.1, "ppl": 4.7},
            "valid_newest": {"step": 100_000, "sentences": 3000, **newest}}


def test_newest_checkpoint_on_newstest2013_beside_table_3() -> None:
    _, items = _audit({"evaluate": _evaluate({"bleu": 24.6, "bleu_tok_split": 25.9, "ppl": 4.95})})
    bleu = items["BLEU, paper's method (tok+split), valid, newest checkpoint"]
    ppl = items["Perplexity per BPE token, valid, newest checkpoint"]
    assert (bleu["verdict"], bleu["run"], ppl["verdict"], ppl["run"]) == ("matches", "25.90", "matches", "4.95")
    assert "25.8" in bleu["paper"] and "4.92" in ppl["paper"] and "sacreBLEU 13a 24.60" in bleu["note"]
    assert items["Valid set, averaged model"]["run"] == "BLEU tok+split 26.10, sacreBLEU 13a 25.00, perplexity 4.70"
    _, items = _audit({"evaluate": _evaluate({"bleu": 23.0, "bleu_tok_split": 24.0, "ppl": 5.5})})
    assert items["BLEU, paper's method (tok+split), valid, newest checkpoint"]["deviation"] == \
        "24.00 (paper: 25.8; matching needs >= 25.3)"
    assert items["Perplexity per BPE token, valid, newest checkpoint"]["deviation"] == \
        "5.50 (paper: 4.92; matching needs <= 5.17)"


@pytest.mark.parametrize(("dataset", "sentences", "why"), [
    ("multi30k", 1014, "multi30k valid set, not newstest2013"),
    ("wmt14", 2000, "valid set of 2000 sentences (newstest2013: 3,000)"),
])
def test_newest_checkpoint_on_another_valid_set_is_not_comparable(dataset: str, sentences: int, why: str) -> None:
    figures = {"bleu": 30.0, "bleu_tok_split": 31.0, "ppl": 3.0, "sentences": sentences}
    report, items = _audit({"evaluate": _evaluate(figures)}, dataset=dataset)
    for name in ("BLEU, paper's method (tok+split), valid, newest checkpoint",
                 "Perplexity per BPE token, valid, newest checkpoint"):
        assert items[name]["verdict"] == "informational" and f"{why}: not comparable" in items[name]["note"]
        assert not any(name in topic["items"] for topic in report["deviation_topics"])


def test_a_newest_checkpoint_better_than_the_average_is_a_warning() -> None:
    newest = {"bleu": 25.6, "bleu_tok_split": 26.5, "ppl": 4.8}
    report, items = _audit({"evaluate": _evaluate(newest, {"bleu": 25.0, "bleu_tok_split": 26.0, "ppl": 4.9})})
    bleu = items["Averaged vs newest checkpoint, valid BLEU"]
    ppl = items["Averaged vs newest checkpoint, valid perplexity"]
    assert bleu["verdict"] == ppl["verdict"] == "warning" and bleu["kind"] == ppl["kind"] == "check"
    assert bleu["run"] == "averaged 25.00, newest checkpoint (step 100,000) 25.60 (sacreBLEU 13a)"
    assert bleu["note"].startswith("the newest checkpoint alone scores better than the average: 25.60 valid BLEU "
                                   "vs 25.00 (+0.60, sacreBLEU 13a, same beam and α)")
    assert ppl["note"] == ("the newest checkpoint alone scores better than the average: valid perplexity 4.80 vs 4.90 "
                           "(per BPE token; evaluate.details.json valid_newest)")
    assert report["warnings"] == [f"{bleu['item']}: {bleu['note']}", f"{ppl['item']}: {ppl['note']}"]
    assert report["summary"]["warnings"] == 2 and report["summary"]["checks"]["warning"] == 2
    assert not any("alone scores better" in d for d in report["deviations"])
    md = render_markdown(report)
    assert f"## Warnings\n\n1. {bleu['item']}: {bleu['note']}\n2. {ppl['item']}: {ppl['note']}\n" in md
    report, items = _audit({"evaluate": _evaluate(newest, {"bleu": 26.0, "bleu_tok_split": 27.0, "ppl": 4.7})})
    assert items["Averaged vs newest checkpoint, valid BLEU"]["verdict"] == "matches"
    assert items["Averaged vs newest checkpoint, valid perplexity"]["note"].startswith("averaging lowers valid "
                                                                                      "perplexity by 0.10")
    assert report["warnings"] == [] and "## Warnings\n\nNone." in render_markdown(report)


@pytest.mark.parametrize(("train_ppl", "warns"), [(4.8, True), (5.0, False)])
def test_last_checkpoint_perplexity_from_training_when_evaluate_has_no_newest(train_ppl: float, warns: bool) -> None:
    """Without valid_newest, the training stage's last validation (same measure) stands for the last checkpoint."""
    evaluate = {"valid": {"bleu": 25.0, "bleu_tok_split": 26.0, "ppl": 4.9}}
    report, items = _audit({"evaluate": evaluate, "train": _train(valid_ppl=train_ppl)})
    ppl = items["Averaged vs newest checkpoint, valid perplexity"]
    assert ppl["verdict"] == ("warning" if warns else "matches")
    assert "train.details.json valid_ppl at step 100,000" in ppl["note"]
    assert items["Averaged vs newest checkpoint, valid BLEU"]["verdict"] == "not measured"
    _, items = _audit({"evaluate": evaluate})
    assert items["Averaged vs newest checkpoint, valid perplexity"]["verdict"] == "not measured"


def test_sources_cut_at_max_positions_deviate() -> None:
    metrics = {"evaluate": {"valid": {"truncated_sources": 0}, "test": {"truncated_sources": 2}}}
    _, items = _audit(metrics)
    cut = items["Sources cut at max_positions"]
    assert cut["verdict"] == "deviates" and cut["run"] == "valid 0, test 2"
    assert cut["deviation"] == "sources truncated at model.max_positions = 1024: valid 0, test 2"


@pytest.mark.parametrize(("rule", "verdict"), [("t2t", "matches"), ("fairseq", "deviates")])
def test_the_beam_rule_is_named_and_fairseqs_deviates_from_the_papers_code(rule: str, verdict: str) -> None:
    params = merged_profile("paper", REPO)
    params["evaluate"]["beam_rule"] = rule
    report = build_audit(synthetic_inputs(params, metrics={"train": _train()}))
    line = next(i for i in report["configuration"] if i["item"] == "Beam search rule")
    assert (line["verdict"], line["run"], line["kind"]) == (verdict, f"beam_rule {rule}", "reference")
    assert line["source"] == "paper silent; §7 names tensor2tensor as its code: tensor2tensor utils/beam_search.py"
    assert line["deviation"] == ("" if rule == "t2t" else "evaluate.beam_rule = fairseq (tensor2tensor "
                                 "utils/beam_search.py: tensor2tensor's: EOS candidates from all 2k finish; stop "
                                 "once no live hypothesis can beat the lowest finished score, even while fewer "
                                 "than k have finished)")
    assert any(d.startswith("Decoding: ") and "evaluate.beam_rule = fairseq" in d
               for d in report["deviations"]) == (rule == "fairseq")

"""A sweep over seeds: the report's mean, standard deviation and 95% confidence interval per setting; the best two
variants compared by paired bootstrap."""

from __future__ import annotations

from pathlib import Path

import yaml

from flows.sweep_work import VariantRecord
from flows.report import paired_lines, registry_lines, render_report, seed_lines
from flows.sweep_spec import load_spec
from pipeline.auditing.paper import PAPER
from pipeline.core.details import EvaluateDetails, Machine, RegisterDetails, TrainDetails
from pipeline.tracking.promotion import decide
from tests.helpers.paths import REPO


def _record(name: str, seed: int, test: float, valid: float, **overrides: object) -> VariantRecord:
    return VariantRecord(name=name, index=seed, status="done", overrides={**overrides, "seed": seed},
                         metrics={"test_bleu": test, "valid_bleu": valid})


def test_three_seeds_give_the_mean_sd_and_students_t_interval_per_setting() -> None:
    records = [_record("s-1", 1, 27.0, 26.0, **{"model.dropout": 0.1}),
               _record("s-2", 2, 27.4, 26.2, **{"model.dropout": 0.1}),
               _record("s-3", 3, 27.8, 26.4, **{"model.dropout": 0.1}),
               _record("s-4", 1, 25.0, 24.0, **{"model.dropout": 0.3}),
               _record("s-5", 2, 99.0, 99.0, **{"model.dropout": 0.3}).model_copy(update={"status": "failed"})]
    lines = seed_lines(("model.dropout", "seed"), records)
    # t(0.975, 2) = 4.3027: half-widths 4.3027 x 0.4 / sqrt(3) = 0.99 (test) and 0.50 (valid)
    assert "| model.dropout=0.1 | 3 | 27.40 ± 0.40 | 26.41 – 28.39 | 26.20 ± 0.20 | 25.70 – 26.70 |" in lines
    # the failed seed is left out
    assert "| model.dropout=0.3 | 1 | 25.00 | - (one seed) | 24.00 | - (one seed) |" in lines
    assert seed_lines(("model.dropout",), records) == []  # no seeds swept: no section


def test_a_wmt14_sweep_says_whether_each_interval_holds_the_papers_figure_in_sacrebleu_terms() -> None:
    runs = [(25.5, 0.1), (26.5, 0.1), (27.0, 0.1), (20.0, 0.3), (20.2, 0.3), (20.4, 0.3)]  # (test BLEU, dropout)
    records = [_record(f"s-{i}", i, test, 20.0, **{"model.dropout": drop}) for i, (test, drop) in enumerate(runs)]
    lines = seed_lines(("model.dropout", "seed"), records, PAPER)  # 25.9-26.6 in sacreBLEU 13a
    said = [line for line in lines if line.startswith("The paper's 27.3 (Transformer (base), Tables 2 and 3)")]
    assert said == ["The paper's 27.3 (Transformer (base), Tables 2 and 3) is about 25.9–26.6 in sacreBLEU 13a: "
                    "inside model.dropout=0.1's 95% CI of test BLEU over seeds.",
                    "The paper's 27.3 (Transformer (base), Tables 2 and 3) is about 25.9–26.6 in sacreBLEU 13a: "
                    "outside model.dropout=0.3's 95% CI of test BLEU over seeds."], lines
    assert not [line for line in seed_lines(("model.dropout", "seed"), records) if "paper" in line]  # not WMT14


def test_seeds_are_a_grid_key_crossed_with_the_others(tmp_path: Path) -> None:
    path = tmp_path / "seeds.yaml"
    path.write_text(yaml.safe_dump({"name": "seeds", "profile": "tiny",
                                    "grid": {"model.dropout": [0.1, 0.3], "seed": [1, 2, 3]}}))
    spec = load_spec(path, REPO)
    assert spec.keys == ("model.dropout", "seed") and len(spec.variants) == 6
    assert [v.overrides["seed"] for v in spec.variants] == [1, 2, 3, 1, 2, 3]


def test_the_best_two_are_compared_by_paired_bootstrap_on_the_test_outputs() -> None:
    refs = [f"sentence {i} has a few more words in it" for i in range(60)]
    near = [*refs[:-1], "something else"]  # one sentence of sixty differs
    close = paired_lines(["a", "b"], [refs, near], refs)
    assert close[1] == "## Best two, paired" and close[-1].startswith("Test BLEU a 100.00 vs b 9")
    assert close[-1].endswith(", within chance at 0.05."), close[-1]
    far = paired_lines(["a", "c"], [refs, ["unrelated words"] * 60], refs)
    assert far[-1].endswith("paired bootstrap (sacreBLEU, 1,000 resamples) p = 0.0010, significant at 0.05."), far


def _register(moved: bool, holder: str | None, decision: str) -> RegisterDetails:
    return RegisterDetails(tracking="on", model_name="demo-transformer", model_version="2", alias="candidate",
                           alias_moved=moved, candidate_version=holder, decision=decision)


def test_the_alias_lines_say_one_thing() -> None:
    """A first registration: moved to this version, beside the decision that no version held it before."""
    first = registry_lines(RegisterDetails(tracking="on", model_name="m", model_version="1", alias="candidate",
                                           alias_moved=True, candidate_version="1",
                                           decision=decide(20.0, {"valid": "x"}, None)[1]))
    assert first == ["- registered model: `models:/m/1`", "- alias `candidate`: moved to this version (1; "
                     "`models:/m@candidate`)", "- decision: no version held the alias before this one"]
    assert "held by" not in "\n".join(first)
    kept = registry_lines(_register(False, "1", "valid BLEU 19.00 <= 20.00 of version 1"))
    assert kept[1] == "- alias `candidate`: stays with version 1 (`models:/demo-transformer@candidate`)"
    moved = registry_lines(_register(True, "2", "valid BLEU 21.00 > 20.00 of version 1"))
    assert moved[1] == "- alias `candidate`: moved to this version (2; `models:/demo-transformer@candidate`)"


def test_the_bleu_section_names_the_machines_the_details_files_record() -> None:
    cpu = Machine(cpu="AMD EPYC 7763 64-Core Processor", cpu_capability="AVX2", threads=2, torch="2.5.1")
    evaluate = EvaluateDetails.from_json({"test": {"bleu": 30.1, "signatures": {"bleu": "nrefs:1|case:mixed"}},
                                          "device": "cpu", "machine": cpu.to_json()}, "evaluate.details.json")
    train = TrainDetails.from_json({"device": "cpu", "machine": cpu.to_json()}, "train.details.json")
    md = render_report([], bleu=evaluate, mlflow_run_id=None, tracking_uri=None, git={}, train=train)
    described = "AMD EPYC 7763 64-Core Processor, AVX2, 2 threads, torch 2.5.1"
    assert f"Machine: trained on cpu (CPU {described}); decoded on cpu (CPU {described})." in md
    assert "Machine:" not in render_report([], bleu=EvaluateDetails(), mlflow_run_id=None, tracking_uri=None, git={})

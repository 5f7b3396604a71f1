"""A sweep over seeds: the report's mean, standard deviation and 95% confidence interval per setting; the best two
variants compared by paired bootstrap."""

from __future__ import annotations

from pathlib import Path

import yaml

from flows.report import paired_lines, seed_lines
from flows.sweep_spec import load_spec
from pipeline.auditing.paper import PAPER
from tests.helpers.paths import REPO


def _record(name: str, seed: int, test: float, valid: float, **overrides: object) -> dict:
    return {"name": name, "status": "done", "overrides": {**overrides, "seed": seed},
            "metrics": {"test_bleu": test, "valid_bleu": valid}}


def test_three_seeds_give_the_mean_sd_and_students_t_interval_per_setting() -> None:
    records = [_record("s-1", 1, 27.0, 26.0, **{"model.dropout": 0.1}),
               _record("s-2", 2, 27.4, 26.2, **{"model.dropout": 0.1}),
               _record("s-3", 3, 27.8, 26.4, **{"model.dropout": 0.1}),
               _record("s-4", 1, 25.0, 24.0, **{"model.dropout": 0.3}),
               {**_record("s-5", 2, 99.0, 99.0, **{"model.dropout": 0.3}), "status": "failed"}]
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

"""Stage ``evaluate`` end to end on a random tiny model, real BPE and real shards; decoding helpers."""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.core.config import EvaluateConfig
from pipeline.core.details import SetFigures
from pipeline.core.errors import CheckpointError, DataError
from pipeline.core.owned import write_lines
from pipeline.core.textio import count_lines, read_lines
from pipeline.evaluate import stage
from pipeline.inference.common import prepare_source
from pipeline.inference.decoding import decode_sources, load_translator, plan_batches, plan_searches
from pipeline.inference.scoring import METRIC_KEYS, score_files
from pipeline.tracking.harness import run_stage
from tests.helpers.eval_world import AVERAGED_STEP, NEWEST_STEP, TEST, VALID

CFG = EvaluateConfig(beam_sizes=[1, 2], alphas=[0.6, 1.0], max_len_a=1.0, max_len_b=4, max_tokens=40)
SMALL = EvaluateConfig(beam_sizes=[1], alphas=[0.6], max_len_b=3, max_tokens=64)


def _dirs(world: Path, **overrides: Path) -> dict[str, Path]:
    """The stage's folder arguments inside ``world`` (eval_dir where given)."""
    dirs = {"model_dir": world / "model", "shards_dir": world / "shards", "raw_dir": world / "raw",
            "train_dir": world / "train", "spm_model": world / "bpe" / "spm.model"}
    return {**dirs, **overrides}


def _evaluate(world: Path, out: Path, cfg: EvaluateConfig = CFG, **overrides: Path) -> dict:
    """The evaluate stage under its wrapper; returns ``evaluate.details.json`` as written."""
    run_stage("evaluate", lambda: stage(cfg, **_dirs(world, eval_dir=out / "eval", **overrides)),
              metrics_dir=out / "metrics")
    return json.loads((out / "metrics" / "evaluate.details.json").read_text(encoding="utf-8"))


def test_evaluate_end_to_end_keeps_every_line_and_reports_everything(eval_world: Path, tmp_path: Path) -> None:
    report = _evaluate(eval_world, tmp_path)
    for split, rows in (("valid", VALID), ("test", TEST)):
        hyp = tmp_path / "eval" / f"{split}.hyp.de"
        lines = list(read_lines(hyp))
        assert len(lines) == len(rows) == count_lines(eval_world / "raw" / f"{split}.de")
        for (src, _), line in zip(rows, lines):
            if not src:
                assert line == ""  # empty source -> empty hypothesis, the line is kept
        figures = report[split]
        for key in METRIC_KEYS:
            assert isinstance(figures[key], float) and key in figures["signatures"]
        assert figures["signatures"]["bleu"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")
        for key in ("sentences", "decode_seconds", "sentences_per_second", "beam", "alpha"):
            assert key in figures
        assert figures["sentences"] == len(rows)
        rescored = score_files(hyp, eval_world / "raw" / f"{split}.de")
        assert {k: getattr(rescored, k) for k in METRIC_KEYS} == {k: figures[k] for k in METRIC_KEYS}
    assert [(g["beam"], g["alpha"]) for g in report["grid"]] == [(1, 0.6), (1, 1.0), (2, 0.6), (2, 1.0)]
    best = max(g["bleu"] for g in report["grid"])
    chosen = report["chosen"]
    assert next(g for g in report["grid"] if g["bleu"] == best) == next(
        g for g in report["grid"] if (g["beam"], g["alpha"]) == (chosen["beam"], chosen["alpha"]))
    assert report["test"]["beam"] == chosen["beam"] and report["test"]["alpha"] == chosen["alpha"]
    assert report["valid"]["bleu"] == pytest.approx(best)


NEWEST_KEYS = {"step", "checkpoint", *METRIC_KEYS, "ppl", "nll", "signatures", "beam", "alpha", "hypotheses"}


def test_the_newest_checkpoint_is_scored_on_valid_beside_the_averaged_model(eval_world: Path,
                                                                           tmp_path: Path) -> None:
    report = _evaluate(eval_world, tmp_path, SMALL)
    newest = report["valid_newest"]
    assert NEWEST_KEYS <= set(newest)
    folder = eval_world / "train" / f"step-{NEWEST_STEP:08d}"
    assert (newest["step"], newest["checkpoint"]) == (NEWEST_STEP, str(folder))
    assert (newest["beam"], newest["alpha"]) == (report["chosen"]["beam"], report["chosen"]["alpha"])
    hyp = tmp_path / "eval" / "valid.newest.hyp.de"
    assert newest["hypotheses"] == str(hyp) and count_lines(hyp) == len(VALID)
    assert list(read_lines(hyp))[1] == ""  # the empty source keeps its (empty) line
    rescored = score_files(hyp, eval_world / "raw" / "valid.de")
    keys = (*METRIC_KEYS, "signatures")
    assert {k: getattr(rescored, k) for k in keys} == {k: newest[k] for k in keys}
    for figures in (report["valid"], newest):
        assert math.isfinite(figures["ppl"]) and figures["ppl"] > 1
        assert figures["ppl"] == pytest.approx(math.exp(figures["nll"]), rel=1e-12)
        assert figures["ppl_skipped"] == 0 and figures["ppl_tokens"] > len(VALID)  # every pair, EOS included
    # step-00000020 holds other random weights than step-00000010, the one averaged.pt is built from
    assert newest["ppl"] != pytest.approx(report["valid"]["ppl"])
    assert hyp.read_bytes() != (tmp_path / "eval" / "valid.hyp.de").read_bytes()
    numbers = json.loads((tmp_path / "metrics" / "evaluate.json").read_text(encoding="utf-8"))  # DVC metrics
    assert numbers == {"valid": {k: report["valid"][k] for k in ("bleu", "chrf2", "ppl")},
                       "test": {k: report["test"][k] for k in ("bleu", "chrf2")}}
    details = json.loads((tmp_path / "metrics" / "evaluate.details.json").read_text(encoding="utf-8"))
    assert details["valid_newest"]["bleu"] == newest["bleu"] and details["valid_newest"]["ppl"] == newest["ppl"]
    assert details["valid_newest"]["step"] == NEWEST_STEP


def test_a_newest_checkpoint_equal_to_the_average_scores_the_same_and_warns_not(
        eval_world: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    only = f"step-{AVERAGED_STEP:08d}"  # averaged.pt is this checkpoint averaged alone
    shutil.copytree(eval_world / "train" / only, tmp_path / "train" / only)
    with caplog.at_level(logging.WARNING, logger="pipeline.evaluate"):
        report = _evaluate(eval_world, tmp_path, SMALL, train_dir=tmp_path / "train")
    keys = (*METRIC_KEYS, "nll", "ppl", "ppl_tokens")
    assert {k: report["valid_newest"][k] for k in keys} == {k: report["valid"][k] for k in keys}
    assert (tmp_path / "eval" / "valid.newest.hyp.de").read_bytes() == (tmp_path / "eval" / "valid.hyp.de").read_bytes()
    assert "averaging hurt" not in caplog.text


def test_a_newest_checkpoint_above_the_average_is_a_warning(eval_world: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.inference import scored_decoding

    real = scored_decoding.score_files

    def newest_better(hyp_path: Path, ref_path: Path, lang: str = "de") -> SetFigures:
        figures = real(hyp_path, ref_path, lang)
        if Path(hyp_path).name == "valid.newest.hyp.de":  # random tiny models both score BLEU 0
            return figures.replace(bleu=(figures.bleu or 0.0) + 10.0)
        return figures

    monkeypatch.setattr(scored_decoding, "score_files", newest_better)
    with caplog.at_level(logging.WARNING, logger="pipeline.evaluate"):
        report = _evaluate(eval_world, tmp_path, SMALL)
    assert report["valid_newest"]["bleu"] > report["valid"]["bleu"]
    warnings = [r.getMessage() for r in caplog.records if "averaging hurt" in r.getMessage()]
    assert len(warnings) == 1 and f"step-{NEWEST_STEP:08d}" in warnings[0]
    assert all(r.levelno == logging.WARNING for r in caplog.records if "averaging hurt" in r.getMessage())


@pytest.mark.parametrize("state", ["missing", "empty", "incomplete"])
def test_no_checkpoint_in_the_train_dir_is_a_one_line_error_and_writes_nothing(eval_world: Path, tmp_path: Path,
                                                                               state: str) -> None:
    train = tmp_path / "train"
    if state != "missing":
        train.mkdir()
    if state == "incomplete":
        (train / "step-00000030").mkdir()  # no DONE: not a checkpoint
    with pytest.raises(CheckpointError) as info:
        stage(SMALL, **_dirs(eval_world, train_dir=train, eval_dir=tmp_path / "eval"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{train}: no complete training checkpoint") and message.endswith("`dvc repro train`")
    assert not (tmp_path / "eval").exists()


def test_hypotheses_are_reproducible_and_do_not_depend_on_the_batch_budget(eval_world: Path, tmp_path: Path) -> None:
    _evaluate(eval_world, tmp_path / "a", CFG)
    _evaluate(eval_world, tmp_path / "b", EvaluateConfig(**{**CFG.__dict__, "max_tokens": 1}))
    for split in ("valid", "test"):
        a = (tmp_path / "a" / "eval" / f"{split}.hyp.de").read_bytes()
        assert a == (tmp_path / "b" / "eval" / f"{split}.hyp.de").read_bytes()


def test_reference_line_count_mismatch_is_a_clear_error_and_writes_nothing(eval_world: Path, tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write_lines(raw / "valid.de", [r[1] for r in VALID])
    write_lines(raw / "test.de", [r[1] for r in TEST][:-1])
    with pytest.raises(DataError, match=rf"{raw / 'test.de'} has 3 lines but the test shards in .* hold 4 sentences"):
        stage(CFG, **_dirs(eval_world, raw_dir=raw, eval_dir=tmp_path / "eval"))
    assert not (tmp_path / "eval").exists()


def test_shards_from_another_bpe_model_are_refused(eval_world: Path, tmp_path: Path) -> None:
    manifest = json.loads((eval_world / "shards" / "manifest.json").read_text())
    shards = tmp_path / "shards"
    import shutil

    shutil.copytree(eval_world / "shards", shards)
    (shards / "manifest.json").write_text(json.dumps({**manifest, "spm_sha256": "0" * 64}))
    with pytest.raises(DataError, match="encoded with spm.model sha256 0{64}, but the model's embedded"):
        stage(CFG, **_dirs(eval_world, shards_dir=shards, eval_dir=tmp_path / "eval"))


@pytest.mark.slow
def test_evaluate_logs_metrics_and_signature_to_mlflow(eval_world: Path, tmp_path: Path, mlflow_sqlite: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root for a SQLite URI is ./mlruns

    report = _evaluate(eval_world, tmp_path, EvaluateConfig(beam_sizes=[1], alphas=[0.6], max_len_b=2, max_tokens=64))
    run = MlflowClient(tracking_uri=mlflow_sqlite).get_run(report["mlflow_run_id"])
    assert run.data.tags["sacrebleu_signature"] == report["test"]["signatures"]["bleu"]
    assert run.data.metrics["test.bleu"] == pytest.approx(report["test"]["bleu"])
    assert "test.bleu_tok_split" in run.data.metrics and "valid.chrf2" in run.data.metrics
    assert run.data.metrics["valid.ppl"] == pytest.approx(report["valid"]["ppl"])
    assert run.data.metrics["valid_newest.bleu"] == pytest.approx(report["valid_newest"]["bleu"])
    assert run.data.metrics["valid_newest.ppl"] == pytest.approx(report["valid_newest"]["ppl"])
    artifacts = [a.path for a in MlflowClient(tracking_uri=mlflow_sqlite).list_artifacts(run.info.run_id)]
    assert "evaluate.details.json" in artifacts


def test_plan_batches_respects_the_budget_and_covers_every_sentence_once() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(0, 30) for _ in range(200)]
    batches = plan_batches(lengths, max_tokens=64)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == [i for i, n in enumerate(lengths) if n > 0]
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * longest <= 64
    assert [lengths[i] for i in flat] == sorted((n for n in lengths if n), reverse=True)


def test_a_search_holds_what_max_tokens_allows_and_overlong_limits_search_apart() -> None:
    rng = random.Random(3)
    sources = [[5] * rng.randint(0, 20) for _ in range(600)]
    translator = SimpleNamespace(config=SimpleNamespace(max_positions=24))  # plan_searches reads max_positions only
    jobs = plan_searches(translator, sources, beam_size=4, max_len_a=1.0, max_len_b=5, max_tokens=16384)
    lengths = [len(s) for s in sources]
    capped = [n if n + 5 > 24 else 0 for n in lengths]  # floor(S + 5) passes the position table
    plain = plan_batches([n if not c else 0 for n, c in zip(lengths, capped)], 16384)
    assert [job[0] for job in jobs] == plain + plan_batches(capped, 16384)
    assert [job[3:] for job in jobs] == [(1.0, 5)] * len(plain) + [(0.0, 24)] * (len(jobs) - len(plain))
    first = jobs[0][0]
    assert len(first) > 262 and len(first) * lengths[first[0]] > 4096  # no cap of its own on any device
    assert all(job[1] == [sources[i] for i in job[0]] and job[2] == 4 for job in jobs)


@pytest.mark.parametrize("rule", ["fairseq", "t2t"])
def test_batched_decoding_restores_order_and_equals_one_at_a_time(eval_world: Path, rule: str) -> None:
    translator = load_translator(eval_world / "model" / "averaged.pt", "cpu")
    translator.model.double()  # float64: batching must not change a single token
    rng = random.Random(1)
    vocab = translator.config.vocab_size
    sources = [prepare_source([rng.randrange(4, vocab) for _ in range(rng.randint(0, 12))], translator.config)[0]
               for _ in range(16)]
    kwargs = {"beam_size": 3, "alphas": [0.0, 0.6, 2.0], "max_len_a": 1.0, "max_len_b": 3, "rule": rule}
    together = decode_sources(translator, sources, max_tokens=200, **kwargs)
    alone = decode_sources(translator, sources, max_tokens=1, **kwargs)
    assert together == alone
    for alpha, hyps in together.items():
        assert [h for h, s in zip(hyps, sources) if not s] == [[] for s in sources if not s]
        for i, src in enumerate(sources):
            if src:
                x = torch.tensor([src])
                from model import beam_search

                assert hyps[i] == beam_search(translator.model, x, beam_size=3, alpha=alpha, max_len_a=1.0,
                                              max_len_b=3, rule=rule)[0]


def test_the_t2t_rule_searches_once_per_alpha_and_reaches_the_search_from_the_stage(
        eval_world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.inference import decoding

    seen, search = [], decoding.beam_search

    def spy(*args, **kwargs):  # the real search, its alpha and rule noted
        seen.append((kwargs["alpha"], kwargs["rule"]))
        return search(*args, **kwargs)

    monkeypatch.setattr(decoding, "beam_search", spy)
    translator = load_translator(eval_world / "model" / "averaged.pt", "cpu")
    for rule, searches in (("fairseq", [(0.6, "fairseq")]), ("t2t", [(0.6, "t2t"), (1.0, "t2t")])):
        seen.clear()
        decode_sources(translator, [[5, 6, 3]], beam_size=2, alphas=[0.6, 1.0], max_len_a=1.0, max_len_b=3,
                       max_tokens=64, rule=rule)
        assert seen == searches
    seen.clear()
    _evaluate(eval_world, tmp_path, EvaluateConfig(**{**SMALL.__dict__, "beam_rule": "t2t"}))
    assert seen and {rule for _, rule in seen} == {"t2t"}


def test_sources_are_truncated_to_max_positions() -> None:
    from model import TransformerConfig

    cfg = TransformerConfig(vocab_size=50, d_model=8, n_heads=2, d_ff=8, n_layers=1, max_positions=6)
    assert prepare_source([5] * 10, cfg) == ([5] * 5 + [cfg.eos_id], True)
    assert prepare_source([5] * 5, cfg) == ([5] * 5 + [cfg.eos_id], False)
    assert prepare_source([], cfg) == ([], False)


def test_train_average_evaluate_chain_on_real_checkpoints(eval_world: Path, tmp_path: Path) -> None:
    """The real train stage's checkpoints feed average, whose model file feeds evaluate."""
    from model import TransformerConfig
    from pipeline.average import stage as average_stage
    from pipeline.core.config import AverageConfig, TrainConfig
    from pipeline.train import stage as train_stage
    from tests.helpers.models import TINY_MODEL

    train_stage(TrainConfig(tokens_per_step=256, warmup_steps=2, max_steps=6, save_every_steps=2,
                            keep_last=3, valid_every_steps=3, log_every_steps=3),
                model_cfg=TransformerConfig(**TINY_MODEL), seed=1, shards_dir=eval_world / "shards",
                spm_model=eval_world / "bpe" / "spm.model", run_dir=tmp_path / "train",
                plots_path=tmp_path / "plots" / "train.csv")
    averaged = average_stage(AverageConfig(last_n=2), train_dir=tmp_path / "train", bpe_dir=eval_world / "bpe",
                             model_dir=tmp_path / "model")
    assert averaged.checkpoints == ["step-00000004", "step-00000006"]
    report = stage(EvaluateConfig(beam_sizes=[2], alphas=[0.6], max_len_b=3, max_tokens=64),
                   **_dirs(eval_world, model_dir=tmp_path / "model", train_dir=tmp_path / "train",
                           eval_dir=tmp_path / "eval"))
    assert count_lines(tmp_path / "eval" / "test.hyp.de") == len(TEST)
    assert report.valid_newest.step == 6 and report.valid_newest.checkpoint == str(tmp_path / "train" / "step-00000006")
    assert math.isfinite(report.valid_newest.ppl or math.nan) and math.isfinite(report.valid.ppl or math.nan)

"""Acceptance: a three-variant sweep of the tiny profile through the real ``wmt14-sweep`` flow, then its restart.

A temporary git + DVC project holds this checkout's pipeline (``tests/helpers/tinyproject.py``); data comes from the
synthetic Multi30k mirror, MLflow writes to a temporary SQLite store and Prefect is the test harness's API. The
three variants are one setting (warmup and learning-rate scale off the profile's; decoding kept cheap: beam 1, at
most a few pieces per sentence) with three seeds (the spec's ``seeds:``), for the report's 95% interval over seeds;
they run two at a time, each as a DVC experiment (``dvc exp run --temp``), compared under one MLflow parent. The
sweep then runs again: everything is finished, so it runs nothing. The assertions share those two runs.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.report import HEADLINE_METRICS
from flows.sweep import artifact_key, wmt14_sweep
from tests.helpers.mirror import write_multi30k_mirror
from tests.helpers.tinyproject import make_tiny_project

pytestmark = pytest.mark.slow

# One setting (warmup and learning-rate scale off the profile's), three seeds: "Over seeds" gives it an interval.
SEEDS = [1, 7, 11]
NAMES = [f"tiny2-{i}" for i in range(1, len(SEEDS) + 1)]
SHARED = {"evaluate.beam_sizes": [1], "evaluate.max_len_a": 0.0, "evaluate.max_len_b": 4, "train.max_steps": 12,
          "train.warmup_steps": 2, "train.lr_scale": 0.5}
DATA_STAGES = ("download", "clean", "bpe", "encode")


@dataclass(frozen=True)
class Sweep:
    """The sweep's two runs: the first runs every variant, the second (a restart) finds them finished."""

    repo: Path
    uri: str
    first: dict[str, Any]
    second: dict[str, Any]
    runs_after_first: list[Any]
    runs_after_second: list[Any]


def _all_runs(uri: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory, prefect_harness: None) -> Iterator[Sweep]:
    tmp = tmp_path_factory.mktemp("sweep-tiny")
    repo = make_tiny_project(tmp / "project")
    spec = tmp / "tiny2.yaml"
    spec.write_text(yaml.safe_dump({"name": "tiny2", "profile": "tiny", "concurrency": 2, "set": SHARED,
                                    "seeds": SEEDS}, sort_keys=False), encoding="utf-8")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NMT_TRACKING", "on")
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("NMT_DATA_MIRROR", str(write_multi30k_mirror(tmp / "mirror")))
        mp.setenv("NMT_DOWNLOAD_CACHE", str(tmp / "download-cache"))
        mp.setenv("NMT_NPROC", "1")
        mp.setenv("NMT_THREADS", "1")
        first = wmt14_sweep(spec_path=str(spec), repo=str(repo))
        after_first = _all_runs(uri)
        second = wmt14_sweep(spec_path=str(spec), repo=str(repo))
        yield Sweep(repo=repo, uri=uri, first=first, second=second, runs_after_first=after_first,
                    runs_after_second=_all_runs(uri))


def _variants(sweep: Sweep) -> dict[str, Any]:
    return {r.data.tags["sweep.variant"]: r for r in sweep.runs_after_first if "sweep.variant" in r.data.tags}


def test_each_variant_an_mlflow_run_under_one_parent_tagged_with_its_overrides(sweep: Sweep) -> None:
    parents = [r for r in sweep.runs_after_first if r.data.tags.get("sweep.parent") == "true"]
    assert [p.info.run_name for p in parents] == ["sweep-tiny2"] and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert parent.info.run_id == sweep.first["mlflow_run_id"]
    variants = _variants(sweep)
    assert sorted(variants) == NAMES
    for i, seed in enumerate(SEEDS, 1):
        run = variants[f"tiny2-{i}"]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["pipeline"] == "true" and run.data.tags["dvc_exp"] == f"tiny2-{i}"
        assert (run.data.tags["override.seed"], run.data.tags["override.train.warmup_steps"],
                run.data.tags["override.train.lr_scale"], run.data.tags["override.evaluate.max_len_b"]) == \
            (str(seed), "2", "0.5", "4")
        assert (run.data.params["seed"], run.data.params["train.warmup_steps"], run.data.params["train.lr_scale"]) == \
            (str(seed), "2", "0.5")
        assert set(run.data.metrics) == set(HEADLINE_METRICS), run.data.metrics  # as a pipeline parent run has
        assert run.data.metrics["train_steps"] == 12.0 and run.info.status == "FINISHED"
        stages = {r.data.tags["stage"] for r in sweep.runs_after_first
                  if r.data.tags.get("mlflow.parentRunId") == run.info.run_id}
        assert {"train", "average", "evaluate"} <= stages and not stages & set(DATA_STAGES), stages


def test_shared_data_stages_ran_once_and_every_variant_restored_them(sweep: Sweep) -> None:
    counts = {stage: sum(r.data.tags.get("stage") == stage for r in sweep.runs_after_first) for stage in DATA_STAGES}
    assert counts == dict.fromkeys(DATA_STAGES, 1), counts  # one MLflow run each, under the sweep's parent
    assert sum(r.data.tags.get("stage") == "train" for r in sweep.runs_after_first) == len(SEEDS)
    for record in sweep.first["records"]:
        assert {s: record["stages"][s] for s in DATA_STAGES} == dict.fromkeys(DATA_STAGES, "restored"), record
        assert record["stages"]["train"] == "ran"


def test_dvc_exp_show_in_the_checkout_lists_the_variants(sweep: Sweep) -> None:
    done = subprocess.run(["dvc", "exp", "show", "--json"], cwd=sweep.repo, capture_output=True, text=True,
                          check=True, timeout=300)
    rows = {}
    for entry in json.loads(done.stdout):
        for group in entry.get("experiments") or []:
            for rev in group["revs"]:
                rows[rev["name"]] = rev["data"]
    assert sorted(rows) == NAMES
    variants = _variants(sweep)
    for name, data in rows.items():
        params = data["params"]["params.yaml"]["data"]
        run = variants[name]
        assert params["seed"] == int(run.data.params["seed"])
        evaluate = next(body["data"] for path, body in data["metrics"].items() if path.endswith("evaluate.json"))
        assert evaluate["valid"]["bleu"] == pytest.approx(run.data.metrics["valid_bleu"])


def test_the_table_names_the_variant_with_the_best_valid_bleu(sweep: Sweep) -> None:
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    variants = _variants(sweep)
    best = max(sorted(variants), key=lambda name: variants[name].data.metrics["valid_bleu"])  # first of equals
    markdown = sweep.first["markdown"]
    assert sweep.first["best"] == best and f"Best: **{best}** (" in markdown
    tests = [variants[n].data.metrics["test_bleu"] for n in NAMES]  # one setting, three seeds
    over_seeds = next(line for line in markdown.splitlines() if line.startswith("| (base) |"))
    assert f"| 3 | {sum(tests) / 3:.2f} ± " in over_seeds, markdown
    assert "The paper's" not in markdown  # Multi30k: the paper's figure does not apply
    assert f"| **{best}** (best) |" in markdown
    second = sorted(NAMES, key=lambda name: -variants[name].data.metrics["valid_bleu"])[1]
    paired = markdown.split("## Best two, paired\n\n", 1)[1].splitlines()[0]  # the variants' test outputs
    assert paired.startswith(f"Test BLEU {best} {variants[best].data.metrics['test_bleu']:.2f} vs {second} "), paired
    assert " paired bootstrap (sacreBLEU, 1,000 resamples) p = " in paired, paired
    for name, run in variants.items():
        row = next(line for line in markdown.splitlines() if line.startswith(f"| {name} |")
                   or line.startswith(f"| **{name}**"))
        assert f"| {run.data.metrics['valid_bleu']:.2f} | {run.data.metrics['test_bleu']:.2f} |" in row
        assert row.endswith("| done |")
    report = sweep.repo / "reports" / "sweeps" / "tiny2.md"
    restarted = markdown.replace(f"; {len(SEEDS)} run now.", "; 0 run now.")
    assert report.read_text(encoding="utf-8") == sweep.second["markdown"] == restarted
    client = MlflowClient(tracking_uri=sweep.uri)
    parent = client.get_run(sweep.first["mlflow_run_id"])
    assert parent.data.tags["sweep.best"] == best
    low, high = (parent.data.metrics[f"seeds/base/test_bleu_{part}"] for part in ("ci_low", "ci_high"))
    assert parent.data.metrics["seeds/base/test_bleu_mean"] == pytest.approx(sum(tests) / 3)
    assert f"| {low:.2f} – {high:.2f} |" in over_seeds  # the interval over seeds, as MLflow metrics of the parent
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"tiny2.md", "spec"}
    key = artifact_key("tiny2")
    with get_client(sync_client=True) as prefect:
        latest = prefect.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert [a.data for a in latest] == [sweep.second["markdown"]]


def test_a_restart_of_the_finished_sweep_runs_nothing(sweep: Sweep) -> None:
    assert len(sweep.first["ran"]) == len(SEEDS) and sweep.second["ran"] == []
    assert sweep.second["records"] == sweep.first["records"]
    assert sweep.second["mlflow_run_id"] == sweep.first["mlflow_run_id"]  # the same parent, reopened
    assert sorted(r.info.run_id for r in sweep.runs_after_second) == \
        sorted(r.info.run_id for r in sweep.runs_after_first)  # no new MLflow run: no stage ran
    assert "0 run now" in sweep.second["markdown"] and sweep.second["best"] == sweep.first["best"]


def test_the_variants_were_prefect_task_runs_two_at_a_time(sweep: Sweep) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
            any_=[sweep.first["flow_run_id"]])))
    variants = sorted((r for r in runs if r.name.startswith("variant ")), key=lambda r: r.start_time)
    assert [r.name for r in sorted(variants, key=lambda r: r.name)] == [f"variant {n}" for n in NAMES]
    assert all(r.state.is_completed() for r in variants)
    edges = sorted([(r.start_time, 1) for r in variants] + [(r.end_time, -1) for r in variants])
    running, most = 0, 0
    for _, step in edges:
        running += step
        most = max(most, running)
    assert most == 2  # both at once: the limit was used (Prefect's ThreadPoolTaskRunner holds it)

"""The audit as one mapping: the paper's settings, the measured items, lineage, and (informational) the keys
this profile changes relative to ``profiles/paper.yaml``, which is never a yardstick."""

from __future__ import annotations

from typing import TypedDict

from pipeline.auditing.dev_items import dev_items
from pipeline.auditing.inputs import FORMAT, GitState, Inputs
from pipeline.auditing.items import Item, fmt, neutral
from pipeline.auditing.paper import bleu_figures, bleu_items, data_items, lineage_items, minor_items, model_items
from pipeline.auditing.paper_rows import BleuGap, PaperRow, bleu_gap, paper_row
from pipeline.auditing.ranking import TopicLine, deviation_topics
from pipeline.auditing.replay import Replay
from pipeline.auditing.run_items import training_items
from pipeline.auditing.settings import OPEN_KEYS, Setting, paper_settings
from pipeline.auditing.summary import Headline, Summary, counts, headline, warnings
from pipeline.core.config import flatten
from pipeline.core.yamlfile import Plain, PlainMapping


class OpenSetting(TypedDict):
    """A params key the paper leaves open: this run's value and the reference setup's."""

    key: str
    run: Plain  # the params value, as params.yaml spells it
    reference: str


class ProfileDifference(TypedDict):
    """A params key whose value differs from ``profiles/paper.yaml`` (informational)."""

    key: str
    paper_profile: Plain  # its value there (None: not there)
    run: Plain  # its value in params.yaml (None: not there)
    kind: str  # paper, operational or unspecified
    paper_verdict: str | None  # the verdict of the paper setting that judges it
    difference: str


class PathMd5(TypedDict):
    """A dep or out of a dvc.lock stage."""

    path: str | None
    md5: str | None


class LineageStage(TypedDict):
    """One dvc.lock stage as the lineage lists it."""

    cmd: str | None
    lock_md5: str  # the MLflow tag dvc_lock_md5
    deps: list[PathMd5]
    outs: list[PathMd5]


class Lineage(TypedDict):
    """dvc.lock hashes per stage, the manifests' sha256s, params.yaml, git and the MLflow run ids."""

    params_sha256: str
    git: GitState
    dvc_lock: dict[str, LineageStage] | None
    raw_manifest: PlainMapping | None  # dataset, files (split, lang, url, member, sha256, bytes, lines), outputs
    shards_manifest: PlainMapping | None  # sha256, spm_sha256, vocab_size, rows and shards per split
    checkpoint_state: str | None
    mlflow_run_ids: dict[str, str | None]


class Audit(TypedDict):
    """The whole audit as audit.json holds it and audit.md renders it (``summary`` counts verdicts per kind)."""

    format: int
    profile: str | None
    dataset: str | None
    summary: Summary
    headline: Headline
    configuration: list[Item]
    measured: list[Item]
    open_settings: list[OpenSetting]
    profile_differences: list[ProfileDifference]
    deviations: list[str]
    deviation_topics: list[TopicLine]
    warnings: list[str]
    bleu_gap: BleuGap
    paper: PaperRow
    bleu_figures: list[dict[str, str | float]]
    replay: Replay
    lineage: Lineage
    environment: dict[str, str | int | None]


def profile_differences(flat: PlainMapping, paper_profile: PlainMapping | None,
                        settings: tuple[Setting, ...]) -> list[ProfileDifference]:
    """Every params key whose value differs from ``profiles/paper.yaml``: informational, never a verdict.

    ``kind`` is ``paper`` (a paper setting judges it), ``operational`` (results do not change) or ``unspecified``.
    """
    if paper_profile is None:
        return []
    ref = flatten(paper_profile)
    verdicts = {key: setting.check(flat)["verdict"] for setting in settings for key in setting.keys}
    out = []
    for key in sorted(set(flat) | set(ref)):
        if key in flat and key in ref and flat[key] == ref[key]:
            continue
        kind = "paper" if key in verdicts else "operational" if neutral(key) else "unspecified"
        out.append(ProfileDifference(key=key, paper_profile=ref.get(key), run=flat.get(key), kind=kind,
                                     paper_verdict=verdicts.get(key),
                                     difference=f"{key} = {fmt(flat.get(key))} (paper profile: {fmt(ref.get(key))})"))
    return out


def lineage(inp: Inputs) -> Lineage:
    """dvc.lock hashes per stage, the manifests' sha256s, params.yaml, git and MLflow run ids."""
    from pipeline.core.stages import lock_md5

    lock = inp.lock or {}
    stages = {name: LineageStage(cmd=entry.get("cmd"), lock_md5=lock_md5(lock, name),
                                 deps=[PathMd5(path=d.get("path"), md5=d.get("md5")) for d in entry.get("deps") or []],
                                 outs=[PathMd5(path=o.get("path"), md5=o.get("md5")) for o in entry.get("outs") or []])
              for name, entry in (lock.get("stages") or {}).items()}
    raw = inp.raw_manifest
    shards = inp.shards_manifest
    run_ids = inp.details.run_ids()
    if inp.state is not None:
        run_ids["train (state.json)"] = inp.state.get("mlflow_run_id")
    return Lineage(
        params_sha256=inp.params_sha256, git=inp.git, dvc_lock=stages if inp.lock is not None else None,
        raw_manifest=None if raw is None else {
            "dataset": raw.get("dataset"),
            "files": [{k: f.get(k) for k in ("split", "lang", "url", "member", "sha256", "bytes", "lines")}
                      for f in raw.get("files") or []],
            "outputs": raw.get("outputs")},
        shards_manifest=None if shards is None else {
            "sha256": inp.shards_manifest_sha256, "spm_sha256": shards.get("spm_sha256"),
            "vocab_size": shards.get("vocab_size"),
            "splits": {split: {"rows": info.get("rows"), "shards": [{k: s.get(k) for k in ("path", "rows", "sha256")}
                                                                     for s in info.get("shards") or []]}
                       for split, info in (shards.get("splits") or {}).items()}},
        checkpoint_state=inp.state_path, mlflow_run_ids=run_ids)


def build_audit(inp: Inputs) -> Audit:
    """The whole audit as one JSON-able mapping (the markdown is rendered from it)."""
    row = paper_row(inp.params)
    settings = paper_settings(row["size"])
    config = [setting.check(inp.flat) for setting in settings] + minor_items()  # code, not params: last
    measured = (model_items(inp) + training_items(inp) + dev_items(inp) + data_items(inp) + bleu_items(inp)
                + lineage_items(inp))  # each "not measured" while its input is missing
    items, topics = config + measured + inp.replay.get("items", []), deviation_topics(config, measured)
    warned, per_kind = warnings(items), counts(items)
    summary = Summary(paper=per_kind["paper"], reference=per_kind["reference"], checks=per_kind["check"],
                      warnings=len(warned), deviation_topics=len(topics))
    dataset = inp.params.download.dataset
    return {"format": FORMAT, "profile": inp.params.profile, "dataset": dataset, "summary": summary,
            "headline": headline(dataset, inp.details.evaluate.test, row),
            "configuration": config, "measured": measured,
            "open_settings": [OpenSetting(key=k, run=inp.flat.get(k), reference=v) for k, v in OPEN_KEYS.items()],
            "profile_differences": profile_differences(inp.flat, inp.paper_profile, settings),
            "deviations": [f"{t['topic']}: {t['text']}" for t in topics], "deviation_topics": topics,
            "warnings": warned, "bleu_gap": bleu_gap(row), "paper": row,
            "bleu_figures": bleu_figures(inp.details.evaluate), "replay": inp.replay,
            "lineage": lineage(inp), "environment": inp.environment}


def tracking_metrics(audit: Audit, inp: Inputs) -> dict[str, float]:
    """The numbers the audit logs to MLflow and returns as the stage's record: verdict counts per kind of item
    (matches count paper items only), warnings, deviation topics, parameters, test BLEU, replay outcome."""
    summary, out = audit["summary"], {}
    paper, ref, checks = summary["paper"], summary["reference"], summary["checks"]
    out.update(matches=paper["matches"], deviates=paper["deviates"], not_measured=paper["not measured"],
               reference_matches=ref["matches"], reference_deviates=ref["deviates"],
               checks_passed=checks["matches"], checks_failed=checks["deviates"], warnings=summary["warnings"],
               deviation_topics=summary["deviation_topics"])
    parameters = inp.model["total"] if inp.model else inp.details.average.parameters
    if parameters is not None:
        out["parameters"] = int(parameters)
    for f in audit["bleu_figures"]:
        if f["set"] == "test" and f["metric"] in ("bleu", "bleu_tok_split"):
            out[f"test_{f['metric']}"] = f["score"]
    replayed = [i for i in audit["replay"].get("items", []) if i["verdict"] != "not measured"]
    if replayed:
        out["replay_identical"] = float(all(i["verdict"] == "matches" for i in replayed))
    return out

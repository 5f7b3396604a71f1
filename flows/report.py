"""The markdown a pipeline run and a sweep leave as Prefect artifacts, and the headline metrics of their MLflow runs.

Ours and not ``dvc exp show --md`` / ``dvc metrics show --md``: those tabulate every param and metric DVC
recorded, not a run's stage statuses, failed variants, best variant, audit or MLflow runs.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.sweep_spec import SweepSpec
from flows.sweep_work import VariantRecord
from pipeline.core.details import Chosen, EvaluateDetails, RegisterDetails, TrainDetails

AUDIT_ARTIFACT_KEY = "wmt14-audit"
AUDIT_LINES = 12  # deviations quoted in the run report; the rest stay in audit.md
#: What the MLflow parent run carries, for MLflow's Compare view (docs/tracking.md, "Comparing runs in MLflow").
HEADLINE_METRICS = ("test_bleu", "valid_bleu", "test_chrf", "valid_chrf", "valid_ppl", "train_steps", "gpu_hours")
OBJECTIVE = "valid_bleu"  # a sweep's: higher is better
# A sweep table's columns: (headline metric, title, format); valid BLEU first: it decides.
SWEEP_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("valid_bleu", "valid BLEU", "{:.2f}"), ("test_bleu", "test BLEU", "{:.2f}"),
    ("valid_chrf", "valid chrF", "{:.2f}"), ("valid_ppl", "valid ppl", "{:.2f}"), ("train_steps", "steps", "{:.0f}"))


@dataclass(frozen=True)
class StageOutcome:
    """What one stage task did."""

    stage: str
    status: str  # ran, skipped, restored, unknown, failed (exit N), timed out or interrupted
    duration_s: float  # of the last attempt (of all attempts for a failure)
    attempts: int = 1  # retries included


def headline_metrics(evaluate: EvaluateDetails | None, train: TrainDetails | None) -> dict[str, float]:
    """The parent run's :data:`HEADLINE_METRICS` from the details files; a missing file or key is left out."""
    evaluate, train = evaluate or EvaluateDetails(), train or TrainDetails()
    found = {"test_bleu": evaluate.test.bleu, "valid_bleu": evaluate.valid.bleu, "test_chrf": evaluate.test.chrf2,
             "valid_chrf": evaluate.valid.chrf2, "valid_ppl": evaluate.valid.ppl, "train_steps": train.step}
    if train.wall_seconds is not None:
        gpus = train.world_size or 1
        found["gpu_hours"] = train.wall_seconds * gpus / 3600 if train.device == "cuda" else 0.0
    return {key: float(value) for key, value in found.items() if value is not None}


def headline_from(metrics_dir: Path) -> dict[str, float]:
    """:func:`headline_metrics` of the details files in ``metrics_dir`` as the DAG left them.

    Raises:
        PipelineError: a details file that is not valid JSON or has a field of the wrong type (names it).
    """
    return headline_metrics(EvaluateDetails.read(metrics_dir), TrainDetails.read(metrics_dir))


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", " ")


def stage_rows(outcomes: Sequence[StageOutcome]) -> list[str]:
    """Markdown rows: stage, status, duration, attempts."""
    rows = ["| stage | status | duration | attempts |", "|---|---|---:|---:|"]
    return rows + [f"| {_cell(o.stage)} | {_cell(o.status)} | {o.duration_s:.1f} s | {o.attempts} |" for o in outcomes]


def bleu_table(bleu: EvaluateDetails, train: TrainDetails | None = None) -> list[str]:
    """Markdown rows from ``evaluate.details.json``: every scored figure per set with its sacreBLEU signature, then
    the machines training and decoding ran on (a CPU of another model or capability may give other BLEU)."""
    rows = ["| set | metric | score | signature |", "|---|---|---:|---|"]
    for name, figures in (("valid", bleu.valid), ("test", bleu.test)):
        scores = {**figures.extra, **figures.scores()}  # a signed score the record does not name is kept too
        for key in list(figures.signatures) or ["bleu"]:
            value = scores.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append(f"| {name} | {_cell(key)} | {value:.2f} | `{_cell(figures.signatures.get(key, ''))}` |")
    if len(rows) == 2:
        return []
    chosen = bleu.chosen
    if chosen != Chosen():
        rows += ["", f"Beam {chosen.beam}, alpha {chosen.alpha} (chosen on {chosen.chosen_on})."]
    return rows + machine_lines(bleu, train)


def machine_lines(bleu: EvaluateDetails, train: TrainDetails | None) -> list[str]:
    """Where the figures come from: the training and decoding devices and CPUs the details files record."""
    found = []
    for what, details in (("trained", train), ("decoded", bleu)):
        cpu = details.machine.describe() if details is not None else None
        device = details.device if details is not None else None
        name = getattr(details, "device_name", None) if device == "cuda" else None
        if cpu or device:
            found.append(f"{what} on {', '.join(x for x in (device, name) if x) or 'an unrecorded device'}"
                         f"{f' (CPU {cpu})' if cpu else ''}")
    return ["", "Machine: " + "; ".join(found) + "."] if found else []


def mlflow_link(tracking_uri: str | None, run_id: str, page: str | None = None) -> str:
    """A link to the run's ``page`` (:func:`pipeline.tracking.store.ui_page`: the training view) when the store is a
    server, else the id and the store."""
    if tracking_uri and tracking_uri.startswith(("http://", "https://")):
        return f"[{run_id}]({page})" if page else f"`{run_id}` on {tracking_uri}"
    return f"`{run_id}`" + (f" in `{tracking_uri}`" if tracking_uri else "")


def mlflow_ui_hint(tracking_uri: str | None, page: str | None = None) -> str | None:
    """How to browse a local store: the ``mlflow ui`` command and the page to open (None for a server)."""
    if not tracking_uri or tracking_uri.startswith(("http://", "https://")):
        return None
    return f"`.venv/bin/mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1` (then " \
           f"{page or 'http://127.0.0.1:5000'})"


def audit_section(audit_path: str, audit_md: str | None, max_lines: int = AUDIT_LINES) -> list[str]:
    """Markdown lines: where the audit report is, its summary line and the first bullets of its ``## Deviations``."""
    if audit_md is None:
        return ["## Replication audit", "", f"No `{audit_path}` yet (the `audit` stage writes it).", ""]
    lines = ["## Replication audit", "", f"Report: `{audit_path}` (also the `{AUDIT_ARTIFACT_KEY}` artifact)."]
    summary = next((ln for ln in audit_md.splitlines()[1:] if ln.strip() and not ln.startswith("#")), "")
    if summary:
        lines += ["", summary]
    section = re.search(r"^## deviations[ \t\r]*$(.*?)(?=^## |\Z)", audit_md, re.IGNORECASE | re.MULTILINE | re.DOTALL)
    bullets = [line for line in section.group(1).splitlines() if line.startswith("- ")] if section else []
    if bullets:
        lines += ["", "Deviations from the paper:", "", *bullets[:max_lines]]
        if len(bullets) > max_lines:
            lines.append(f"- ... and {len(bullets) - max_lines} more in `{audit_path}`")
    return lines + [""]


def registry_lines(register: RegisterDetails) -> list[str]:
    """Markdown bullets from ``register.details.json``: registered version, alias holder and the decision."""
    name, version = register.model_name, register.model_version
    if not (name and version):
        reason = register.decision or register.tracking
        return [f"- registered model: none ({_cell(reason)})"] if reason else []
    alias, holder = register.alias or "candidate", register.candidate_version
    if register.alias_moved:
        where = f"moved to this version ({version}; `models:/{name}@{alias}`)"
    elif holder:
        where = f"stays with version {holder} (`models:/{name}@{alias}`)"
    else:
        where = "not moved (no version holds it)"
    lines = [f"- registered model: `models:/{name}/{version}`", f"- alias `{alias}`: {where}"]
    return lines + ([f"- decision: {_cell(register.decision)}"] if register.decision else [])


def render_report(outcomes: Sequence[StageOutcome], *, bleu: EvaluateDetails | None, mlflow_run_id: str | None,
                  tracking_uri: str | None, git: Mapping[str, str], failure: str | None = None,
                  audit_path: str | None = None, audit_md: str | None = None,
                  register: RegisterDetails | None = None, ui_page: str | None = None,
                  train: TrainDetails | None = None) -> str:
    """The whole report: stages, BLEU (with the machines of ``train`` and ``bleu``), the audit (None: no section),
    lineage and the failure (if any)."""
    table = bleu_table(bleu or EvaluateDetails(), train) or ["No `evaluate.details.json` yet."]
    lines = ["# wmt14-pipeline", "", "## Stages", "", *stage_rows(outcomes), "", "## BLEU", "", *table, ""]
    if audit_path:
        lines += audit_section(audit_path, audit_md)
    dirty = " (uncommitted changes)" if git.get("git_dirty") == "true" else ""
    run = mlflow_link(tracking_uri, mlflow_run_id, ui_page) if mlflow_run_id else "tracking off (`NMT_TRACKING=off`)"
    lines += ["## Lineage", "", f"- git commit: `{git.get('git_commit') or 'unknown (not a git checkout)'}`{dirty}",
              f"- MLflow parent run: {run}"]
    hint = mlflow_ui_hint(tracking_uri, ui_page) if mlflow_run_id else None
    lines += ([f"- MLflow UI: {hint}"] if hint else []) + registry_lines(register or RegisterDetails())
    if failure:
        lines += ["", "## Failure", "", "```", failure, "```"]
    return "\n".join(lines) + "\n"


def best_variant(records: Sequence[VariantRecord]) -> VariantRecord | None:
    """The finished sweep variant with the highest valid BLEU (the first of equals, in spec order), or None."""
    done = [r for r in records if r.status == "done" and OBJECTIVE in r.metrics]
    return max(done, key=lambda r: r.metrics[OBJECTIVE], default=None)  # max keeps the first of equals


def _overrides(record: VariantRecord, keys: Sequence[str]) -> str:
    return ", ".join(f"{k}={_cell(record.overrides[k])}" for k in keys if k in record.overrides)


@dataclass(frozen=True)
class SeedStat:
    """One metric over a setting's finished seeds: mean, sample sd and 95% CI (Student's t); None for one seed."""

    n: int
    mean: float
    sd: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


def seed_stats(keys: Sequence[str], records: Sequence[VariantRecord]) -> dict[str, dict[str, SeedStat]]:
    """With ``seed`` among the swept keys: {setting of the other keys ("(base)": none): {test_bleu, valid_bleu}}."""
    from scipy.stats import t  # only for a sweep over seeds

    groups: dict[str, list[VariantRecord]] = {}
    for r in records if "seed" in keys else ():
        if r.status == "done":
            groups.setdefault(_overrides(r, [k for k in keys if k != "seed"]) or "(base)", []).append(r)
    out: dict[str, dict[str, SeedStat]] = {setting: {} for setting in groups}
    for (setting, runs), metric in itertools.product(groups.items(), ("test_bleu", "valid_bleu")):
        values = [r.metrics[metric] for r in runs if metric in r.metrics]
        if len(values) > 1:
            mean, sd = statistics.fmean(values), statistics.stdev(values)
            half = t.ppf(0.975, len(values) - 1) * sd / math.sqrt(len(values))
            out[setting][metric] = SeedStat(len(values), mean, sd, mean - half, mean + half)
        elif values:
            out[setting][metric] = SeedStat(1, values[0])
    return out


def seed_lines(keys: Sequence[str], records: Sequence[VariantRecord],
               paper: Mapping[str, Any] | None = None) -> list[str]:
    """The "Over seeds" table of :func:`seed_stats`; with ``paper`` (the paper's row, for a WMT14 newstest2014 test
    set), whether each setting's test interval holds the paper's figure in sacreBLEU 13a terms."""
    stats = seed_stats(keys, records)
    lines = ["", "## Over seeds", "", "| setting | seeds | test BLEU mean ± sd | 95% CI | valid BLEU mean ± sd | "
             "95% CI |", "|---|---:|---:|---:|---:|---:|"] if stats else []
    for setting, by_metric in stats.items():
        cells = [setting, str(max(s.n for s in by_metric.values()))]
        for s in (by_metric.get("test_bleu"), by_metric.get("valid_bleu")):
            cells += ([f"{s.mean:.2f}" if s else "-", "- (one seed)"] if s is None or s.sd is None
                      else [f"{s.mean:.2f} ± {s.sd:.2f}", f"{s.ci_low:.2f} – {s.ci_high:.2f}"])
        lines.append("| " + " | ".join(cells) + " |")
    tests = {k: t for k, v in stats.items() if paper and (t := v.get("test_bleu")) and t.sd is not None}
    for setting, s in tests.items():  # each with an interval (two seeds or more)
        (lo, hi), (a, b) = paper["sacrebleu_equivalent"], (s.ci_low, s.ci_high)
        where = "inside" if a <= lo and hi <= b else "outside" if b < lo or a > hi else "partly in"
        lines += ["", f"The paper's {paper['bleu_en_de']} ({paper['row']}) is about {lo}–{hi} in sacreBLEU 13a: "
                  f"{where} {setting}'s 95% CI of test BLEU over seeds."]
    return lines


def paired_lines(names: Sequence[str], hyps: Sequence[Sequence[str]], refs: Sequence[str]) -> list[str]:
    """The best two variants' test BLEU by sacreBLEU's paired bootstrap resampling (its 1,000 resamples and fixed
    seed; Koehn 2004): the p-value of a difference at least this large arising by chance."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    _, scores = PairedTest(list(zip(names, hyps)), {"BLEU": BLEU()}, [list(refs)], test_type="bs", n_samples=1000)()
    best, second = scores["BLEU"]
    return ["", "## Best two, paired", "", f"Test BLEU {names[0]} {best.score:.2f} vs {names[1]} {second.score:.2f}: "
            f"paired bootstrap (sacreBLEU, 1,000 resamples) p = {second.p_value:.4f}, "
            f"{'significant' if second.p_value < 0.05 else 'within chance'} at 0.05."]


def render_sweep(spec: SweepSpec, records: Sequence[VariantRecord], *, commit: str, ran: int,
                 mlflow_run_id: str | None, tracking_uri: str | None, paired: Sequence[str] = (),
                 paper: Mapping[str, Any] | None = None, ui_page: str | None = None) -> str:
    """A sweep's markdown from ``records`` (one per variant in spec order); ``ran``: how many this run executed;
    ``paired``: :func:`paired_lines` of the best two, if any; ``paper``: as :func:`seed_lines` takes it;
    ``ui_page``: as :func:`render_report` takes it."""
    keys = spec.keys
    shared = ", ".join(f"{k}={_cell(v)}" for k, v in spec.shared.items())
    intro = (f"Base profile `{spec.profile}`{f' with {shared}' if shared else ''}; {len(records)} variants at commit "
             f"`{commit[:12]}`; {ran} run now. The objective is valid BLEU (higher is better).")
    best = best_variant(records)
    head = ["variant", *keys, *(title for _, title, _ in SWEEP_COLUMNS), "status"]
    lines = [f"# Sweep {spec.name}", "", intro, "", "| " + " | ".join(head) + " |",
             "|---|" + "---:|" * (len(keys) + len(SWEEP_COLUMNS)) + "---|"]
    for record in records:
        cells = [f"**{record.name}** (best)" if record is best else record.name,
                 *(_cell(record.overrides[k]) if k in record.overrides else "" for k in keys),
                 *(fmt.format(record.metrics[m]) if m in record.metrics else "-" for m, _, fmt in SWEEP_COLUMNS),
                 _cell(record.status)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if best is not None:
        test = best.metrics.get("test_bleu", float("nan"))
        lines.append(f"Best: **{best.name}** ({_overrides(best, keys) or 'the base profile'}): valid BLEU "
                     f"{best.metrics[OBJECTIVE]:.2f}, test BLEU {test:.2f}.")
    else:
        lines.append("Best: none (no variant finished with a valid BLEU).")
    lines += [*seed_lines(keys, records, paper), *paired]
    lines += ["", "## Where to look", "",
              f"- DVC: `dvc exp show --only-changed` in this checkout lists the experiments "
              f"{', '.join(r.name for r in records)}; `dvc exp apply {best.name if best else '<name>'}` "
              "brings one's params and metrics into the workspace."]
    if mlflow_run_id:
        lines.append(f"- MLflow: parent run `{spec.run_name}` {mlflow_link(tracking_uri, mlflow_run_id, ui_page)}; "
                     "expand it in the runs table, select its variant runs and press Compare.")
        hint = mlflow_ui_hint(tracking_uri, ui_page)
        lines += [f"- MLflow UI: {hint}"] if hint else []
    failed = [r for r in records if r.status != "done"]
    if failed:
        lines += ["", "## Not finished", "", *(f"- {r.name}: {_cell(r.error or r.status)}" for r in failed)]
    return "\n".join(lines) + "\n"

"""The markdown report a pipeline run leaves as a Prefect artifact (plain Python, no Prefect import)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_SETS = ("valid", "test")
AUDIT_ARTIFACT_KEY = "wmt14-audit"
AUDIT_LINES = 12  # deviations quoted in the run report; the rest stay in audit.md
#: What the MLflow parent run carries, for MLflow's Compare view (README, "Comparing runs in MLflow").
HEADLINE_METRICS = ("test_bleu", "valid_bleu", "test_chrf", "valid_chrf", "valid_ppl", "train_steps", "gpu_hours")


@dataclass(frozen=True)
class StageOutcome:
    """What one stage task did.

    Attributes:
        stage: DVC stage name.
        status: ``ran``, ``skipped``, ``restored``, ``unknown`` or ``failed (exit N)``.
        duration_s: wall time of the last attempt (of all attempts for a failure).
        attempts: how many times the task ran (retries included).
    """

    stage: str
    status: str
    duration_s: float
    attempts: int = 1


def _number(record: Mapping[str, Any], *keys: str) -> float | None:
    """The number at ``record[k0][k1]...``, or None (missing, not a number, a bool)."""
    value: Any = record
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def headline_metrics(evaluate: Mapping[str, Any], train: Mapping[str, Any]) -> dict[str, float]:
    """The parent run's metrics (:data:`HEADLINE_METRICS`) from ``evaluate.details.json`` and ``train.details.json``.

    BLEU and chrF of valid and test, valid perplexity (the evaluated model's), training steps, and
    GPU-hours = train wall seconds x GPUs / 3600 (0.0 when it trained on CPU). A figure whose file
    or key is missing is left out.
    """
    found = {"test_bleu": _number(evaluate, "test", "bleu"), "valid_bleu": _number(evaluate, "valid", "bleu"),
             "test_chrf": _number(evaluate, "test", "chrf2"), "valid_chrf": _number(evaluate, "valid", "chrf2"),
             "valid_ppl": _number(evaluate, "valid", "ppl"), "train_steps": _number(train, "step")}
    wall, gpus = _number(train, "wall_seconds"), _number(train, "world_size")
    if wall is not None:
        found["gpu_hours"] = wall * (gpus or 1.0) / 3600 if train.get("device") == "cuda" else 0.0
    return {key: value for key, value in found.items() if value is not None}


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def stage_table(outcomes: Sequence[StageOutcome]) -> list[str]:
    """Markdown rows: stage, status, duration, attempts."""
    rows = ["| stage | status | duration | attempts |", "|---|---|---:|---:|"]
    rows += [f"| {_cell(o.stage)} | {_cell(o.status)} | {o.duration_s:.1f} s | {o.attempts} |" for o in outcomes]
    return rows


def bleu_table(bleu: Mapping[str, Any]) -> list[str]:
    """Markdown rows from ``evaluate.details.json``: every scored figure per set with its sacreBLEU signature."""
    rows = ["| set | metric | score | signature |", "|---|---|---:|---|"]
    for name in _SETS:
        figures = bleu.get(name)
        if not isinstance(figures, Mapping):
            continue
        signatures = figures.get("signatures") or {}
        keys = list(signatures) or [k for k, v in figures.items() if k == "bleu" and isinstance(v, (int, float))]
        for key in keys:
            value = figures.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append(f"| {name} | {_cell(key)} | {value:.2f} | `{_cell(signatures.get(key, ''))}` |")
    if len(rows) == 2:
        return []
    chosen = bleu.get("chosen")
    if isinstance(chosen, Mapping):
        rows.append("")
        rows.append(f"Beam {chosen.get('beam')}, alpha {chosen.get('alpha')} (chosen on {chosen.get('chosen_on')}).")
    return rows


def mlflow_link(tracking_uri: str | None, run_id: str) -> str:
    """A link to the run in the MLflow UI when the store is a server, else the id and the store."""
    if tracking_uri and tracking_uri.startswith(("http://", "https://")):
        return f"[{run_id}]({tracking_uri.rstrip('/')}/#/runs/{run_id})"
    where = f" in `{tracking_uri}`" if tracking_uri else ""
    return f"`{run_id}`{where}"


def mlflow_ui_hint(tracking_uri: str | None, page: str | None = None) -> str | None:
    """How to browse a local store: the ``mlflow ui`` command and the page to open (None for a server, which is
    its own UI); ``page`` defaults to the UI's start page."""
    if not tracking_uri or tracking_uri.startswith(("http://", "https://")):
        return None
    page = page or "http://127.0.0.1:5000"
    return f"`.venv/bin/mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1` (then {page})"


def audit_deviations(audit_md: str) -> list[str]:
    """The bullet lines of the ``## Deviations`` section of ``audit.md`` (empty when it has none)."""
    bullets: list[str] = []
    inside = False
    for line in audit_md.splitlines():
        if line.startswith("## "):
            if inside:
                break
            inside = line.strip().lower() == "## deviations"
        elif inside and line.startswith("- "):
            bullets.append(line)
    return bullets


def audit_section(audit_path: str, audit_md: str | None, max_lines: int = AUDIT_LINES) -> list[str]:
    """Markdown lines: where the audit report is, its summary line and its first deviations."""
    if audit_md is None:
        return ["## Replication audit", "", f"No `{audit_path}` yet (the `audit` stage writes it).", ""]
    lines = ["## Replication audit", "", f"Report: `{audit_path}` (also the `{AUDIT_ARTIFACT_KEY}` artifact)."]
    summary = next((ln for ln in audit_md.splitlines()[1:] if ln.strip() and not ln.startswith("#")), "")
    if summary:
        lines += ["", summary]
    bullets = audit_deviations(audit_md)
    if bullets:
        lines += ["", "Deviations from the paper:", "", *bullets[:max_lines]]
        if len(bullets) > max_lines:
            lines.append(f"- ... and {len(bullets) - max_lines} more in `{audit_path}`")
    return lines + [""]


def registry_lines(register: Mapping[str, Any]) -> list[str]:
    """Markdown bullets from ``register.details.json``: registered version, alias holder and the decision."""
    name, version = register.get("model_name"), register.get("model_version")
    if not (name and version):
        reason = register.get("decision") or register.get("tracking")
        return [f"- registered model: none ({_cell(reason)})"] if reason else []
    alias = register.get("alias") or "candidate"
    holder = register.get("candidate_version")
    moved = "moved to this version" if register.get("alias_moved") else "not moved"
    lines = [f"- registered model: `models:/{name}/{version}`",
             f"- alias `{alias}`: {moved} (held by version {holder}: `models:/{name}@{alias}`)"
             if holder else f"- alias `{alias}`: {moved}"]
    if register.get("decision"):
        lines.append(f"- decision: {_cell(register['decision'])}")
    return lines


def render_report(outcomes: Sequence[StageOutcome], *, bleu: Mapping[str, Any], mlflow_run_id: str | None,
                  tracking_uri: str | None, git: Mapping[str, str], failure: str | None = None,
                  audit_path: str | None = None, audit_md: str | None = None,
                  register: Mapping[str, Any] | None = None, ui_page: str | None = None) -> str:
    """The whole report: stages, BLEU, the audit, lineage (git, MLflow, registry), failure (if any).

    Args:
        outcomes: one per stage task that started.
        bleu: ``evaluate.details.json`` (empty: not scored yet).
        mlflow_run_id: the parent run (None: tracking off).
        tracking_uri: the MLflow store (a server gets a link, a local store the ``mlflow ui`` command).
        git: ``git_commit`` and ``git_dirty``.
        failure: the error that ended the run.
        audit_path: ``<paths.reports>/audit.md`` relative to the repository (None: no audit section).
        audit_md: its text (None: not written yet).
        register: ``register.details.json`` (None or empty: no registry lines).
        ui_page: the page a local ``mlflow ui`` should open (:func:`flows.parent_run.ui_page`).
    """
    lines = ["# wmt14-pipeline", "", "## Stages", "", *stage_table(outcomes), ""]
    table = bleu_table(bleu)
    lines += ["## BLEU", "", *table, ""] if table else ["## BLEU", "", "No `evaluate.details.json` yet.", ""]
    if audit_path:
        lines += audit_section(audit_path, audit_md)
    lines += ["## Lineage", ""]
    commit = git.get("git_commit") or "unknown (not a git checkout)"
    dirty = " (uncommitted changes)" if git.get("git_dirty") == "true" else ""
    lines.append(f"- git commit: `{commit}`{dirty}")
    run = mlflow_link(tracking_uri, mlflow_run_id) if mlflow_run_id else "tracking off (`NMT_TRACKING=off`)"
    lines.append(f"- MLflow parent run: {run}")
    hint = mlflow_ui_hint(tracking_uri, ui_page) if mlflow_run_id else None
    if hint:
        lines.append(f"- MLflow UI: {hint}")
    lines += registry_lines(register or {})
    if failure:
        lines += ["", "## Failure", "", "```", failure, "```"]
    return "\n".join(lines) + "\n"

"""The markdown report a pipeline run leaves as a Prefect artifact (plain Python, no Prefect import)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_SETS = ("valid", "test")


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


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def stage_table(outcomes: Sequence[StageOutcome]) -> list[str]:
    """Markdown rows: stage, status, duration, attempts."""
    rows = ["| stage | status | duration | attempts |", "|---|---|---:|---:|"]
    rows += [f"| {_cell(o.stage)} | {_cell(o.status)} | {o.duration_s:.1f} s | {o.attempts} |" for o in outcomes]
    return rows


def bleu_table(bleu: Mapping[str, Any]) -> list[str]:
    """Markdown rows from ``bleu.json``: every scored figure per set with its sacreBLEU signature."""
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


def render_report(outcomes: Sequence[StageOutcome], *, bleu: Mapping[str, Any], mlflow_run_id: str | None,
                  tracking_uri: str | None, git: Mapping[str, str], failure: str | None = None) -> str:
    """The whole report: stage table, BLEU (if any), MLflow parent run, git commit, failure (if any)."""
    lines = ["# wmt14-pipeline", "", "## Stages", "", *stage_table(outcomes), ""]
    table = bleu_table(bleu)
    lines += ["## BLEU", "", *table, ""] if table else ["## BLEU", "", "No `bleu.json` yet.", ""]
    lines += ["## Lineage", ""]
    commit = git.get("git_commit") or "unknown (not a git checkout)"
    dirty = " (uncommitted changes)" if git.get("git_dirty") == "true" else ""
    lines.append(f"- git commit: `{commit}`{dirty}")
    run = mlflow_link(tracking_uri, mlflow_run_id) if mlflow_run_id else "tracking off (`NMT_TRACKING=off`)"
    lines.append(f"- MLflow parent run: {run}")
    if failure:
        lines += ["", "## Failure", "", "```", failure, "```"]
    return "\n".join(lines) + "\n"

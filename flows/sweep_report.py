"""The table a sweep ends with: variants x headline metrics, valid BLEU decides (plain Python, no Prefect)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from flows.report import mlflow_link, mlflow_ui_hint
from flows.sweep_spec import SweepSpec

OBJECTIVE = "valid_bleu"
# (headline metric, column title, format); valid BLEU first: it decides.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("valid_bleu", "valid BLEU", "{:.2f}"), ("test_bleu", "test BLEU", "{:.2f}"),
    ("valid_chrf", "valid chrF", "{:.2f}"), ("valid_ppl", "valid ppl", "{:.2f}"), ("train_steps", "steps", "{:.0f}"))


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", " ")


def best_variant(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The finished variant with the highest valid BLEU (the first of equals, in spec order), or None."""
    best = None
    for record in records:
        score = (record.get("metrics") or {}).get(OBJECTIVE)
        if record.get("status") == "done" and isinstance(score, (int, float)):
            if best is None or score > best["metrics"][OBJECTIVE]:
                best = record
    return best


def results_table(spec: SweepSpec, records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown rows: one per variant (its own overrides, then the headline metrics and status)."""
    best = best_variant(records)
    head = ["variant", *spec.keys, *(title for _, title, _ in COLUMNS), "status"]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(spec.keys) + len(COLUMNS)) + "---|"]
    for record in records:
        metrics = record.get("metrics") or {}
        name = f"**{record['name']}** (best)" if record is best else record["name"]
        own = [_cell(record["overrides"][k]) if k in record["overrides"] else "" for k in spec.keys]
        figures = [fmt.format(metrics[key]) if isinstance(metrics.get(key), (int, float)) else "-"
                   for key, _, fmt in COLUMNS]
        rows.append("| " + " | ".join([name, *own, *figures, _cell(record.get("status", "not run"))]) + " |")
    return rows


def render_sweep(spec: SweepSpec, records: Sequence[Mapping[str, Any]], *, commit: str, ran: int,
                 mlflow_run_id: str | None, tracking_uri: str | None) -> str:
    """The sweep's markdown: the table, the best variant, where DVC and MLflow show them.

    Args:
        spec: the checked spec.
        records: one per variant, in spec order (``name``, ``overrides``, ``status``, ``metrics``, ...).
        commit: the commit every variant ran.
        ran: how many variants this run executed (0: all were done already).
        mlflow_run_id: the sweep's parent run (None: tracking off).
        tracking_uri: the MLflow store.
    """
    best = best_variant(records)
    shared = ", ".join(f"{k}={_cell(v)}" for k, v in spec.shared.items())
    lines = [f"# Sweep {spec.name}", "",
             f"Base profile `{spec.profile}`{f' with {shared}' if shared else ''}; {len(records)} variants at "
             f"commit `{commit[:12]}`; {ran} run now. The objective is valid BLEU (higher is better).", "",
             *results_table(spec, records), ""]
    if best is not None:
        own = ", ".join(f"{k}={_cell(best['overrides'][k])}" for k in spec.keys if k in best["overrides"]) \
            or "the base profile"
        lines.append(f"Best: **{best['name']}** ({own}): valid BLEU {best['metrics'][OBJECTIVE]:.2f}, "
                     f"test BLEU {best['metrics'].get('test_bleu', float('nan')):.2f}.")
    else:
        lines.append("Best: none (no variant finished with a valid BLEU).")
    lines += ["", "## Where to look", "",
              f"- DVC: `dvc exp show --only-changed` in this checkout lists the experiments "
              f"{', '.join(r['name'] for r in records)}; `dvc exp apply {best['name'] if best else '<name>'}` "
              "brings one's params and metrics into the workspace."]
    if mlflow_run_id:
        lines.append(f"- MLflow: parent run `{spec.run_name}` {mlflow_link(tracking_uri, mlflow_run_id)}; "
                     "expand it in the runs table, select its variant runs and press Compare.")
        hint = mlflow_ui_hint(tracking_uri)
        if hint:
            lines.append(f"- MLflow UI: {hint}")
    failed = [r for r in records if r.get("status") not in ("done",)]
    if failed:
        lines += ["", "## Not finished", ""]
        lines += [f"- {r['name']}: {_cell(r.get('error') or r.get('status', 'not run'))}" for r in failed]
    return "\n".join(lines) + "\n"

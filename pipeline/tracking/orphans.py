"""The runs a killed process left ``RUNNING``: each run is tagged with its owner (:func:`pipeline.core.owner.owner`)
and checkout, and a later run of that checkout marks the runs of ended owners ``KILLED``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipeline.core.owner import owner, owner_gone
from pipeline.tracking.store import enabled, experiment_name, mlflow_client

log = logging.getLogger(__name__)

#: The run's owner: ``<host>/<pid>/<start>``.
OWNER_TAG = "nmt.owner"
#: The checkout (or sweep clone) the run belongs to, resolved.
CHECKOUT_TAG = "nmt.checkout"


def owner_tags(root: str | Path) -> dict[str, str]:
    """The tags that let a later run find this run if this process dies with it open."""
    return {OWNER_TAG: owner(), CHECKOUT_TAG: str(Path(root).resolve())}


def in_checkout(value: str, root: str | Path) -> bool:
    """Whether ``value`` (a :data:`CHECKOUT_TAG`) is ``root`` or a folder inside it (a sweep's clones)."""
    base = str(Path(root).resolve())
    return value == base or value.startswith(base.rstrip(os.sep) + os.sep)


def end_orphaned_runs(root: str | Path = ".",
                      logger: logging.Logger | logging.LoggerAdapter | None = None) -> list[str]:
    """Mark ``KILLED`` the ``RUNNING`` runs of ``root`` whose owner is gone, logging each; return their ids."""
    if not enabled() or (exp := (client := mlflow_client(root)).get_experiment_by_name(experiment_name())) is None:
        return []
    ended: list[str] = []
    token = None
    while True:
        page = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000, page_token=token)
        for run in page:
            tags, run_id = run.data.tags, run.info.run_id
            if in_checkout(tags.get(CHECKOUT_TAG, ""), root) and owner_gone(tags.get(OWNER_TAG, "")):
                client.set_tag(run_id, "nmt.ended_by", "a later run: the process that held it open was gone")
                client.set_terminated(run_id, status="KILLED")
                (logger or log).info("marked MLflow run %s (%s) KILLED: its process %s ended without closing it",
                                     run_id, tags.get("mlflow.runName", "?"), tags[OWNER_TAG])
                ended.append(run_id)
        if not (token := page.token):
            return ended

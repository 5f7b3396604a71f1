"""MLflow runs behind one small interface: a stage's run (opened on first use), a flow's parent run, their tags, and
the end of those a killed process left ``RUNNING`` (each run is tagged with its owner process and checkout)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pipeline.core import env, gitstate
from pipeline.core.owner import owner, owner_gone
from pipeline.core.yamlfile import Plain, PlainMapping
from pipeline.tracking.store import enabled, experiment_id, experiment_name, is_server, mlflow_client, ui_url

log = logging.getLogger(__name__)
#: The run's owner: ``<host>/<pid>/<start>``.
OWNER_TAG = "nmt.owner"
#: The checkout (or sweep clone) the run belongs to, resolved.
CHECKOUT_TAG = "nmt.checkout"

_CURRENT: contextvars.ContextVar[StageRun | None] = contextvars.ContextVar("nmt_stage_run", default=None)

def git_tags(root: str | Path = ".", *, temporary_params: bool = False) -> dict[str, str]:
    """Git commit and dirty flag of ``root`` (empty outside a git checkout) by :mod:`pipeline.core.gitstate`'s rule,
    with MLflow's standard source tags (:func:`source_tags`)."""
    if (commit := gitstate.commit(root)) is None:
        return {"git_commit": "", "git_dirty": "", **source_tags(root, None)}
    dirty = gitstate.dirty_paths(root, temporary_params=temporary_params)
    return {"git_commit": commit, "git_dirty": str(bool(dirty)).lower(), **source_tags(root, commit)}


def source_tags(root: str | Path, commit: str | None) -> dict[str, str]:
    """The tags MLflow's fluent ``start_run`` sets and its UI shows as a run's Source (``mlflow.source.name``,
    ``.type``, ``mlflow.user``; ``mlflow.source.git.commit``, ``.branch``, ``.repoURL`` of ``root`` where known):
    the client's ``create_run`` sets none. MLflow's own context providers and git helpers (credentials stripped
    from the remote's URL), the checkout being ``root`` rather than the main file's."""
    from mlflow.tracking.context.default_context import DefaultRunContext
    from mlflow.utils import mlflow_tags
    from mlflow.utils.git_utils import get_git_branch, get_git_repo_url

    tags = dict(DefaultRunContext().tags())
    if commit:
        where = str(Path(root).resolve())
        found = {mlflow_tags.MLFLOW_GIT_COMMIT: commit, mlflow_tags.MLFLOW_GIT_BRANCH: get_git_branch(where),
                 mlflow_tags.MLFLOW_GIT_REPO_URL: get_git_repo_url(where)}
        tags.update({k: v for k, v in found.items() if v})
    return tags


class StageRun:
    """A handle on one MLflow run, no-ops when tracking is off; a stage's handle opens its run on first use."""

    def __init__(self, client: Any = None, run_id: str | None = None,
                 opener: Callable[[str | None], tuple[Any, str]] | None = None) -> None:
        self._client, self._run_id, self._opener = client, run_id, opener
        self._resume_id: str | None = None
        self._queued: PlainMapping = {}
        self._monitor: Any = None
        self.system_metrics = False  # set before the run opens: sample CPU, memory, disk, GPU into it

    @property
    def opened(self) -> bool:
        """Whether the run exists (a lazy stage run that nothing used has not been created)."""
        return self._client is not None

    @property
    def client(self) -> Any:
        """The run's MLflow client (opens a lazy run); None when tracking is off."""
        self._live()
        return self._client

    @property
    def run_id(self) -> str | None:
        """The run's id (opens a lazy run); None when tracking is off."""
        self._live()
        return self._run_id

    def open(self) -> None:
        """Create (or continue) the run now rather than on first use."""
        self._live()

    def resume(self, run_id: str | None) -> None:
        """Continue ``run_id`` (a resumed training) instead of creating a run; call before any logging."""
        if self._opener is not None and run_id:
            self._resume_id = run_id

    def queue_params(self, params: Mapping[str, Plain]) -> None:
        """Params to log when a new run opens (not a resumed one)."""
        self._queued.update(params)

    def _live(self) -> bool:
        if self._client is None and self._opener is not None:
            opener, self._opener = self._opener, None
            self._client, self._run_id = opener(self._resume_id)
            resumed = self._run_id == self._resume_id  # else a new run (none to resume, or the store lost it)
            if not resumed and self._queued:
                self.log_params(self._queued)
            if self.system_metrics:  # MLflow's system/* metrics (GPUs need nvidia-ml-py)
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                self._monitor = SystemMetricsMonitor(self._run_id, resume_logging=resumed,
                                                     tracking_uri=self._client.tracking_uri)
                self._monitor.start()
        return self._client is not None

    def close(self, status: str) -> None:
        """Stop the system metrics monitor and end the run with ``status``."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        if self._client is not None:  # on a server, log the run's page on the UI's training view
            self._client.set_terminated(self._run_id, status=status)
            if is_server(uri := str(self._client.tracking_uri)):
                experiment = self._client.get_run(self._run_id).info.experiment_id
                log.info("MLflow run %s (%s): %s", self._run_id, status, ui_url(uri, experiment, self._run_id))

    def log_params(self, params: Mapping[str, Plain]) -> None:
        """Log params (values stringified, 500-char limit respected) in batches."""
        if not self._live():
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:500]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self._client.log_batch(self._run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log numeric metrics at ``step`` (non-numbers are skipped)."""
        if not self._live():
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if items:
            self._client.log_batch(self._run_id, metrics=items)

    def set_tags(self, tags: Mapping[str, Plain]) -> None:
        """Set tags (values stringified)."""
        if self._live():
            for k, v in tags.items():
                self._client.set_tag(self._run_id, k, str(v))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or directory as an artifact."""
        if self._live():
            self._client.log_artifact(self._run_id, str(path), artifact_path)


@contextlib.contextmanager
def _current(handle: StageRun) -> Iterator[StageRun]:
    """``handle`` as :func:`current` for the block, ended FAILED when the block raises (an error ending it is a
    warning: tracking must never mask the block's own error)."""
    token = _CURRENT.set(handle)
    status = "FAILED"
    try:
        yield handle
        status = "FINISHED"
    finally:
        _CURRENT.reset(token)
        if handle.opened:
            try:
                handle.close(status)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not close MLflow run %s: %s", handle._run_id, exc)


def stage_run(stage: str, *, root: str | Path = ".", active: bool = True,
              system_metrics: bool = False) -> contextlib.AbstractContextManager[StageRun]:
    """One stage's :class:`StageRun`, opened on first use but dated from the block's start (no-op if not ``active``)."""
    if not (active and enabled()):
        return _current(StageRun())
    mlflow_client(root)  # its checks of the store: before the stage's work, not when its run first opens
    started_ms = int(time.time() * 1000)
    handle = StageRun(opener=lambda resume: _open_stage_run(stage, Path(root), resume, started_ms))
    handle.system_metrics = system_metrics
    return _current(handle)


def open_run(name: str, *, root: str | Path, tags: dict[str, str],
             reopen: str | None = None) -> contextlib.AbstractContextManager[StageRun]:
    """An MLflow run for the ``with`` block (a flow's parent run), FAILED when it raises, owned by this process;
    ``reopen``: continue that run (a new one when the store has no such run)."""
    def opener(_: str | None) -> tuple[Any, str]:
        client = mlflow_client(root)
        all_tags = {"mlflow.runName": name, **tags, **owner_tags(root)}
        return client, reopen if reopen and _reopen(client, reopen, all_tags) else _create(client, root, name, tags)

    handle = StageRun(opener=opener) if enabled() else StageRun()
    handle.open()
    return _current(handle)


def system_metrics_wanted(stage: str, device: str | None, cuda_available: bool) -> bool:
    """Whether ``stage``'s run samples system metrics: the train run on CUDA (``device``: ``NMT_DEVICE``)."""
    return stage == "train" and cuda_available and device != "cpu"


def _open_stage_run(stage: str, root: Path, resume_run_id: str | None, started_ms: int) -> tuple[Any, str]:
    client = mlflow_client(root)
    if resume_run_id and _reopen(client, resume_run_id, owner_tags(root)):  # this process holds it open now
        return client, resume_run_id
    s = env.settings()
    tags = {"stage": stage, **git_tags(root, temporary_params=bool(s.profile_run))}
    optional = {"profile": s.profile_run, "mlflow.parentRunId": os.environ.get("MLFLOW_PARENT_RUN_ID"),
                "prefect.flow_run_id": s.prefect_flow_run_id}
    tags.update({k: v for k, v in optional.items() if v})
    return client, _create(client, root, stage, tags, started_ms)


def _create(client: Any, root: str | Path, name: str, tags: dict[str, str], started_ms: int | None = None) -> str:
    """A new run named ``name`` with ``tags``, owned by this process; its id."""
    tags = {"mlflow.runName": name, **tags, **owner_tags(root)}
    return client.create_run(experiment_id(client, root), start_time=started_ms, tags=tags, run_name=name).info.run_id


def _reopen(client: Any, run_id: str, tags: dict[str, str]) -> bool:
    """Set ``run_id`` RUNNING again with ``tags``; False (a warning) when the store has no such run."""
    try:
        client.update_run(run_id, status="RUNNING")
        StageRun(client, run_id).set_tags(tags)
    except Exception as exc:  # noqa: BLE001 - e.g. deleted, or another tracking store since
        log.warning("could not reopen MLflow run %s (%s): opening a new one", run_id, exc)
        return False
    return True


def child_run(parent_id: str | None, tag: str, value: str, root: str | Path = ".") -> str | None:
    """The newest child run of ``parent_id`` whose tag ``tag`` is ``value``, or None (also when tracking is off)."""
    if not (enabled() and parent_id):
        return None
    client = mlflow_client(root)
    experiment = client.get_run(parent_id).info.experiment_id
    quoted = value.replace("'", "\\'")
    runs = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent_id}' and "
                                                          f"tags.`{tag}` = '{quoted}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def tag_run(run_id: str, tags: Mapping[str, Plain], root: str | Path = ".") -> None:
    """Set string tags on run ``run_id`` (one another process opened and closed: a stage's, from its flow)."""
    StageRun(mlflow_client(root), run_id).set_tags(tags)


def current() -> StageRun:
    """The run of the stage being executed (inside :func:`stage_run`), else a no-op handle."""
    return _CURRENT.get() or StageRun()


def owner_tags(root: str | Path) -> dict[str, str]:
    """The tags that let a later run find this run if this process dies with it open (:func:`end_orphaned_runs`)."""
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

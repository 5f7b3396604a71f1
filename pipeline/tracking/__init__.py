"""MLflow's one home (tests/test_layering.py): ``from pipeline import tracking`` gives the runs and the store; the
other modules here (the stage harness, the model registry, the pyfunc, ``nmt serve``'s app) are imported by name."""

from pipeline.tracking.runs import (StageRun, child_run, current, end_orphaned_runs, git_tags, open_run, stage_run,
                                    system_metrics_wanted, tag_run)
from pipeline.tracking.store import (DEFAULT_EXPERIMENT, enabled, mlflow_client, require_configured_server,
                                     require_server, store_lock, tracking_uri, ui_page)

__all__ = ["DEFAULT_EXPERIMENT", "StageRun", "child_run", "current", "enabled", "end_orphaned_runs", "git_tags",
           "mlflow_client", "open_run", "require_configured_server", "require_server", "stage_run", "store_lock",
           "system_metrics_wanted", "tag_run", "tracking_uri", "ui_page"]

"""MLflow's one home: every ``import mlflow`` of the project is in this package (tests/test_layering.py says so).

``from pipeline import tracking`` gives the runs and the store (:mod:`.runs`, :mod:`.store`, :mod:`.orphans`);
the stage harness (:mod:`.harness`), the model registry (:mod:`.model_registry`), the register stage's model
promotion (:mod:`.promotion`), the pyfunc MLflow loads (:mod:`.pyfunc`) and ``nmt serve``'s app (:mod:`.scoring_app`)
are imported by name.
"""

from pipeline.tracking.orphans import end_orphaned_runs
from pipeline.tracking.runs import (StageRun, child_run, current, git_tags, open_run, stage_run, system_metrics_wanted,
                                    tag_run)
from pipeline.tracking.store import (DEFAULT_EXPERIMENT, enabled, mlflow_client, require_configured_server,
                                     require_server, store_lock, tracking_uri, ui_page)

__all__ = ["DEFAULT_EXPERIMENT", "StageRun", "child_run", "current", "enabled", "end_orphaned_runs", "git_tags",
           "mlflow_client", "open_run", "require_configured_server", "require_server", "stage_run", "store_lock",
           "system_metrics_wanted", "tag_run", "tracking_uri", "ui_page"]

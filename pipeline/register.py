"""Stage ``register``: log the averaged model once as an MLflow pyfunc translator and maybe move ``candidate``.

The model is logged into this stage's run with the decoding defaults evaluate chose on valid and registered
as a new version of the profile's registered model (``NMT_MODEL_NAME`` to name another);
:mod:`pipeline.tracking.promotion` does the work. A rerun with the same ``averaged.pt`` and the same beam and α
logs nothing and points its record at that version. The alias ``candidate`` moves only to a model with a higher
VALID BLEU on the same references (the test set never chooses); a paired bootstrap of both models' test hypotheses
is recorded beside the decision.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from pipeline import tracking
from pipeline.core import env, stages
from pipeline.core.config import EvaluateConfig, Params
from pipeline.core.details import (DatasetInput, PairedBootstrap, PreviousCandidate, RegisteredFigures,
                                   RegisterDetails)
from pipeline.core.gitstate import commit
from pipeline.project.workspace import exclusive_run
from pipeline.tracking import model_registry as registry
from pipeline.tracking import promotion as registration
from pipeline.tracking.harness import stage_main
from pipeline.tracking.model_registry import ModelVersion
from pipeline.tracking.promotion import ALIAS, SPLITS

log = logging.getLogger(__name__)
#: How long a registration waits for another one into the same MLflow store (each takes seconds).
REGISTER_WAIT_S = 600


def _record_only(name: str, new: RegisteredFigures, decision: str, *, existing: ModelVersion | None = None,
                 holder: ModelVersion | None = None) -> RegisterDetails:
    """The record of a run that logs nothing (tracking off, or this model already registered)."""
    log.info("register: %s", decision)
    return RegisterDetails(tracking="on" if tracking.enabled() else "off", model_name=name, alias=ALIAS,
                           alias_moved=False, decision=decision, mlflow_run_id=existing.run_id if existing else None,
                           model_version=existing.version if existing else None,
                           candidate_version=holder.version if holder else None, new=new)


def stage(cfg: EvaluateConfig, *, model_dir: str | Path, eval_dir: str | Path, raw_dir: str | Path,
          bleu_path: str | Path, lock_path: str | Path = "dvc.lock",
          dataset_paths: dict[str, tuple[str, str]] | None = None, root: str | Path = ".", profile: str = "paper",
          dataset: str = "wmt14") -> RegisterDetails:
    """Log and register the averaged model; move ``candidate`` if it wins on valid BLEU; return the decision record.

    Args:
        cfg: the ``evaluate`` section (the served model decodes with its length and batch limits).
        bleu_path: evaluate's ``evaluate.details.json`` (valid/test BLEU, chosen beam and α).
        lock_path: ``dvc.lock``, whose md5s of ``dataset_paths`` (name → (DVC out, MLflow context)) are logged.
        profile, dataset: name the registered model (:func:`pipeline.core.env.model_name`) and tag it.

    Raises:
        CheckpointError, DataError: missing or inconsistent inputs (nothing is logged then).
    """
    inputs = registration.gather_inputs(model_dir, eval_dir, raw_dir, bleu_path)
    name, chosen = env.model_name(profile), inputs.evaluation
    new = RegisteredFigures(valid_bleu=chosen.valid_bleu, test_bleu=chosen.test_bleu, beam=chosen.beam,
                            alpha=chosen.alpha)
    if not tracking.enabled():
        return _record_only(name, new, "tracking is off (NMT_TRACKING=off): nothing logged or "
                            "registered; `dvc repro -f register` with tracking on to register this model")
    # One registration into a store at a time (a sweep's variants finish together): each reads the alias holder
    # and may move the alias, which MLflow cannot compare-and-set; two at once failed on the alias's row.
    with exclusive_run(root, f"register {name}", "wait for it to end or stop it", lock=tracking.store_lock(root),
                       wait_s=REGISTER_WAIT_S):
        return _register(cfg, inputs, name, new, lock_path=lock_path, dataset_paths=dataset_paths or {}, root=root,
                         profile=profile, dataset=dataset)


def _register(cfg: EvaluateConfig, inputs: registration.Inputs, name: str, new: RegisteredFigures, *,
              lock_path: str | Path, dataset_paths: dict[str, tuple[str, str]], root: str | Path, profile: str,
              dataset: str) -> RegisterDetails:
    """:func:`stage`'s registration, under the store's lock."""
    chosen = inputs.evaluation
    holder = registry.alias_holder(name, ALIAS, root)
    if same := registry.find_model_versions(name, {"averaged_sha256": inputs.averaged_sha256, "beam": chosen.beam,
                                                  "alpha": chosen.alpha}, root):
        return _record_only(name, new, f"this averaged.pt with beam {chosen.beam}, alpha "
                            f"{chosen.alpha} is already version {same[0].version}: not logged again",
                            existing=same[0], holder=holder)
    run = tracking.current()
    with tempfile.TemporaryDirectory(prefix="nmt-register-") as tmp:
        work = Path(tmp)
        datasets = registration.log_lineage(run, inputs, name, lock_path, dataset_paths)
        info = registration.log_model(run, cfg, inputs, name, work, root)
        version = info.version
        registry.describe_model(name, f"The Transformer of Vaswani et al. (2017) trained by this pipeline: profile "
                                f"{profile}, dataset {dataset}. Each version is one averaged model, tagged with its "
                                f"valid and test BLEU and commit; alias {ALIAS}: the best valid BLEU so far.",
                                {"profile": profile, "dataset": dataset}, root)
        registry.tag_model_version(name, version, {"run_id": run.run_id, **new.model_dump(),
                                                   "commit": commit(root) or "none",
                                                   "averaged_sha256": inputs.averaged_sha256,
                                                   **{f"{s}_ref_sha256": inputs.ref_sha[s] for s in SPLITS}}, root)
        bootstrap, not_compared = registration.compare(holder, inputs, work, root)
        moved, decision = registration.decide(chosen.valid_bleu, inputs.ref_sha, holder)
        if moved:
            registry.set_alias(name, ALIAS, version, root)
        previous = None if holder is None else PreviousCandidate(
            version=holder.version, run_id=holder.run_id, valid_bleu=_float_tag(holder, "valid_bleu"),
            test_bleu=_float_tag(holder, "test_bleu"))
        record = RegisterDetails(
            tracking="on", model_name=name, alias=ALIAS, alias_moved=moved, decision=decision,
            mlflow_run_id=run.run_id, model_version=version,
            candidate_version=version if moved else holder.version if holder else None,
            model_uri=info.model_uri, registered_uri=f"models:/{name}/{version}", new=new,
            previous_candidate=previous, paired_bootstrap=None if bootstrap is None else PairedBootstrap(**bootstrap),
            paired_bootstrap_skipped=not_compared,
            datasets=[DatasetInput(name=d["name"], digest=d["digest"], context=d["context"]) for d in datasets])
        registration.log_decision(run, record, chosen, bootstrap, holder)
    log.info("registered %s version %s (%s); alias %s %s", name, version, decision, ALIAS, "moved" if moved else "kept")
    return record


def _float_tag(version: ModelVersion, key: str) -> float | None:
    """Tag ``key`` of ``version`` as a number (None when it has none)."""
    return float(version.tags[key]) if key in version.tags else None


def _run(params: Params, args: argparse.Namespace) -> RegisterDetails:
    paths = params.paths
    return stage(params.evaluate, model_dir=paths.model, eval_dir=paths.eval, raw_dir=paths.raw,
                 bleu_path=stages.details_file(paths.metrics, "evaluate"),
                 dataset_paths={"raw": (paths.raw, "source"), "bpe": (paths.bpe, "training"),
                                "shards": (paths.shards, "training")},
                 profile=params.profile, dataset=params.download.dataset)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.register``."""
    return stage_main("register", _run, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Stage ``register``: log the averaged model once as an MLflow pyfunc translator and maybe move ``candidate``.

After ``evaluate``: the model file is logged "from code" (:mod:`pipeline.inference.mlflow_model`) into this
stage's MLflow run, with ``averaged.pt`` (which embeds the SentencePiece model) and ``spm.model``
as artifacts, the ``pipeline`` and ``model`` sources beside it (so it loads anywhere), string in /
string out, and ``beam_size`` / ``alpha`` as request params defaulting to the values the evaluate
stage chose on the valid set. It is registered as a new version of ``wmt14-transformer``
(``NMT_MODEL_NAME`` overrides the name). DVC reruns the stage only when its inputs change; a rerun
with the same ``averaged.pt`` (sha256) and the same chosen beam and α (``dvc repro -f``, or an
evaluate rerun that only changed timings) logs nothing and points its record at that version.

The alias ``candidate`` moves to the new version only if no version holds it yet, or the new model
has a higher VALID BLEU than the holder (the test set never chooses). Both models' test
hypotheses (each register run keeps its own as artifacts under ``hyps/``) are compared by
sacreBLEU's paired bootstrap resampling (1000 resamples, seed ``$SACREBLEU_SEED`` or 12345); the
p-value is logged and recorded beside the decision. Models scored against other references
(another dataset or profile) are not comparable: the alias stays and the record says why.

The run also records its dataset inputs (raw text, BPE model, shards) with their dvc.lock md5s.
``<paths.metrics>/register.details.json`` holds the run id, version, decision, p-value and both BLEUs.
With ``NMT_TRACKING=off`` nothing is logged and the record says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from pipeline.core import env, stages, tracking
from pipeline.core.config import EvaluateConfig, Params
from pipeline.core.errors import DataError
from pipeline.core.stage import read_json, stage_main
from pipeline.core.textio import read_lines, sha256_file
from pipeline.inference import ct2, model_file, registry

log = logging.getLogger(__name__)

MODEL_NAME_ENV = "NMT_MODEL_NAME"
DEFAULT_MODEL_NAME = env.Settings.model_name
ALIAS = "candidate"
HYPS_ARTIFACT_DIR = "hyps"
BOOTSTRAP_SAMPLES = 1000
MODEL_FILE = Path(__file__).resolve().parent / "inference" / "mlflow_model.py"
#: what the served model imports (versions pinned from this environment).
REQUIREMENTS = ("mlflow", "torch", "sentencepiece", "numpy", "pandas", "pyyaml", "ctranslate2")
SPLITS = ("valid", "test")
#: Packages copied whole into the logged model (so it loads outside this checkout): all of their
#: files are this stage's code deps.
CODE_PACKAGES = ("pipeline", "model")


def model_name() -> str:
    """The registered model name: ``$NMT_MODEL_NAME`` or ``wmt14-transformer``."""
    return env.settings().model_name


def read_bleu(path: str | Path) -> dict[str, Any]:
    """The figures register needs from evaluate's ``evaluate.details.json``.

    Returns:
        ``{"valid_bleu", "test_bleu", "beam", "alpha", "signature", "evaluate_run_id"}``.

    Raises:
        PipelineError/DataError: missing file, bad JSON, or a missing key (named, with the remedy).
    """
    report = read_json(path)
    try:
        return {"valid_bleu": float(report["valid"]["bleu"]), "test_bleu": float(report["test"]["bleu"]),
                "beam": int(report["chosen"]["beam"]), "alpha": float(report["chosen"]["alpha"]),
                "signature": str(report["test"].get("signatures", {}).get("bleu", "")),
                "evaluate_run_id": report.get("mlflow_run_id")}
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: lacks {exc} (needs valid.bleu, test.bleu, chosen.beam, chosen.alpha); "
                        "rerun `dvc repro evaluate`") from None


def dvc_datasets(lock_path: str | Path, wanted: dict[str, tuple[str, str]]) -> list[dict[str, str]]:
    """Dataset inputs from the outs recorded in ``dvc.lock``.

    Args:
        lock_path: the ``dvc.lock`` file (absent: no datasets, with a warning).
        wanted: dataset name → (out path as in dvc.yaml, MLflow context such as ``training``).

    Returns:
        One ``{"name", "digest", "source", "context"}`` per wanted path found (digest = DVC md5).

    Raises:
        DataError: ``dvc.lock`` is not valid YAML.
    """
    lock_path = Path(lock_path)
    if not lock_path.is_file():
        log.warning("%s not found: dataset inputs are not recorded (run the pipeline with dvc repro)", lock_path)
        return []
    try:
        lock = yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = (getattr(exc, "problem", None) or str(exc).splitlines()[0]) + (
            f" at line {mark.line + 1}" if mark is not None else "")
        raise DataError(f"{lock_path}: not valid YAML ({problem}); restore it with `git checkout dvc.lock`") from None
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for stage_name, entry in (lock.get("stages") or {}).items():
        for out in (entry or {}).get("outs") or []:
            if isinstance(out, dict) and "path" in out:
                found[os.path.normpath(str(out["path"]))] = (stage_name, out)
    datasets = []
    for name, (path, context) in wanted.items():
        hit = found.get(os.path.normpath(path))
        if hit is None or not hit[1].get("md5"):
            log.warning("%s has no md5 for %s: dataset %r not recorded", lock_path, path, name)
            continue
        stage_name, out = hit
        source = {"path": str(out["path"]), "stage": stage_name, "md5": out["md5"], "lock": lock_path.name,
                  **{k: out[k] for k in ("size", "nfiles") if k in out}}
        datasets.append({"name": name, "digest": str(out["md5"]), "context": context,
                         "source": json.dumps(source, sort_keys=True)})
    return datasets


def paired_bootstrap(new_hyps: list[str], candidate_hyps: list[str], refs: list[str],
                     n_samples: int = BOOTSTRAP_SAMPLES) -> dict[str, Any]:
    """sacreBLEU's paired bootstrap resampling (BLEU 13a cased), the candidate as baseline.

    Returns:
        ``{"p_value", "n_samples", "signature", "identical_hypotheses", "new_bleu", "new_mean", "new_ci",
        "candidate_bleu", "candidate_mean", "candidate_ci"}``; p is the probability of a BLEU difference
        at least this large arising by chance.

    Raises:
        DataError: the three line lists differ in length.
    """
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    if not len(new_hyps) == len(candidate_hyps) == len(refs):
        raise DataError(f"paired bootstrap needs equal lengths: new {len(new_hyps)}, candidate "
                        f"{len(candidate_hyps)}, references {len(refs)} lines")
    test = PairedTest([("candidate", candidate_hyps), ("new", new_hyps)], {"BLEU": BLEU(tokenize="13a")},
                      references=[refs], test_type="bs", n_samples=n_samples)
    signatures, scores = test()
    (metric,) = (k for k in scores if k != "System")
    baseline, system = scores[metric]
    # Note: sacreBLEU gives p = 1/(n+1) for two identical systems (a zero difference is never "by chance").
    return {"p_value": float(system.p_value), "n_samples": n_samples, "signature": signatures[metric].format(),
            "identical_hypotheses": list(new_hyps) == list(candidate_hyps),
            "new_bleu": float(system.score), "new_mean": float(system.mean), "new_ci": float(system.ci),
            "candidate_bleu": float(baseline.score), "candidate_mean": float(baseline.mean),
            "candidate_ci": float(baseline.ci)}


def decide(new_valid: float, new_refs: dict[str, str], holder: dict[str, Any] | None) -> tuple[bool, str]:
    """Whether ``candidate`` moves to the new version, and why (valid BLEU only; the test set never chooses)."""
    if holder is None:
        return True, "no version held the alias"
    tags = holder["tags"]
    if tags.get("valid_ref_sha256") != new_refs["valid"]:
        return False, (f"version {holder['version']} was scored against other valid references (another dataset or "
                       f"profile): not comparable; set {MODEL_NAME_ENV} to register this model under its own name")
    try:
        old_valid = float(tags["valid_bleu"])
    except (KeyError, ValueError):
        return False, (f"version {holder['version']} has no valid_bleu tag: cannot compare; move the alias by hand "
                       "if this model should replace it")
    if new_valid > old_valid:
        return True, f"valid BLEU {new_valid:.2f} > {old_valid:.2f} of version {holder['version']}"
    return False, f"valid BLEU {new_valid:.2f} <= {old_valid:.2f} of version {holder['version']}"


def _requirements() -> list[str]:
    """``name==version`` of what the served model imports (local version suffixes such as ``+cpu`` dropped)."""
    reqs = []
    for dist in REQUIREMENTS:
        try:
            reqs.append(f"{dist}=={metadata.version(dist).split('+')[0]}")
        except metadata.PackageNotFoundError:
            continue
    return reqs


def _code_copies(work: Path) -> list[str]:
    """Copies of the :data:`CODE_PACKAGES` sources (no bytecode) to ship beside the model."""
    import importlib

    dirs = []
    for name in CODE_PACKAGES:
        package = Path(importlib.import_module(name).__file__).resolve().parent
        dst = work / "code" / package.name
        shutil.copytree(package, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        dirs.append(str(dst))
    return dirs


def _inputs(model_dir: str | Path, eval_dir: str | Path, raw_dir: str | Path, bleu_path: str | Path) -> dict[str, Any]:
    """Check and gather the stage's inputs before anything is logged.

    Raises:
        CheckpointError: no ``averaged.pt``. DataError: a hypothesis or reference file missing, or
            hypotheses that do not cover their reference line for line; bad ``evaluate.details.json``.
    """
    from pipeline.core.errors import CheckpointError

    averaged = model_file.path_in(model_dir)
    if not averaged.is_file():
        raise CheckpointError(f"{averaged}: not found; run `dvc repro average`")
    model_file.verify(averaged)  # with tracking off nothing else reads it: a changed file is refused here too
    bleu = read_bleu(bleu_path)
    hyps = {s: Path(eval_dir) / f"{s}.hyp.de" for s in SPLITS}
    refs = {s: Path(raw_dir) / f"{s}.de" for s in SPLITS}
    for split in SPLITS:
        for path, remedy in ((hyps[split], "dvc repro evaluate"), (refs[split], "dvc repro download")):
            if not path.is_file():
                raise DataError(f"{path}: not found; run `{remedy}`")
        n_hyp, n_ref = (sum(1 for _ in read_lines(p)) for p in (hyps[split], refs[split]))
        if n_hyp != n_ref:
            raise DataError(f"{hyps[split]} has {n_hyp} lines but {refs[split]} has {n_ref}: the hypotheses are from "
                            "another set; rerun `dvc repro evaluate`")
    return {"averaged": averaged, "averaged_sha256": sha256_file(averaged), "bleu": bleu, "hyps": hyps, "refs": refs,
            "ref_sha": {s: sha256_file(refs[s]) for s in SPLITS}}


def _log_model(run: tracking.StageRun, cfg: EvaluateConfig, inputs: dict[str, Any], name: str,
               work: Path, root: str | Path) -> dict[str, Any]:
    """Log and register the pyfunc translator; returns ``{"model_uri", "model_id", "version"}``."""
    spm_path = work / "spm.model"
    spm_path.write_bytes(model_file.load(inputs["averaged"], mmap=True).spm)
    bleu = inputs["bleu"]
    artifacts = {"averaged": str(inputs["averaged"]), "spm": str(spm_path)}
    model_config = {"beam_size": bleu["beam"], "alpha": bleu["alpha"], "max_len_a": cfg.max_len_a,
                    "max_len_b": cfg.max_len_b, "max_tokens": cfg.max_tokens, "engine": "torch"}
    quantization = env.settings().register_ctranslate2
    if quantization != "off":  # NMT_REGISTER_CTRANSLATE2
        artifacts["ctranslate2"] = str(ct2.export(inputs["averaged"], work / "ctranslate2", quantization))
        model_config["engine"] = "ctranslate2"
    info = registry.log_pyfunc_model(
        run, python_model=MODEL_FILE, artifacts=artifacts, code_paths=_code_copies(work), model_config=model_config,
        params={"beam_size": bleu["beam"], "alpha": bleu["alpha"], "engine": model_config["engine"]},
        registered_model_name=name, pip_requirements=_requirements(), root=root)
    assert info is not None and info["version"] is not None  # tracking is on here
    return info


def _compare(holder: dict[str, Any] | None, inputs: dict[str, Any], work: Path,
             root: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """Paired bootstrap of the new vs the candidate's test hypotheses, or (None, why it was not run)."""
    if holder is None:
        return None, "no candidate to compare with"
    if holder["tags"].get("test_ref_sha256") != inputs["ref_sha"]["test"]:
        return None, f"version {holder['version']} was scored against other test references"
    fetched = None
    if holder.get("run_id"):
        fetched = registry.download_run_artifact(holder["run_id"], f"{HYPS_ARTIFACT_DIR}/test.hyp.de",
                                                 work / "candidate", root)
    if fetched is None:
        return None, f"version {holder['version']}'s run has no {HYPS_ARTIFACT_DIR}/test.hyp.de artifact"
    result = paired_bootstrap(list(read_lines(inputs["hyps"]["test"])), list(read_lines(fetched)),
                              list(read_lines(inputs["refs"]["test"])))
    log.info("paired bootstrap on test vs version %s: BLEU %.2f vs %.2f, p = %.4f", holder["version"],
             result["new_bleu"], result["candidate_bleu"], result["p_value"])
    return result, None


def _log_lineage(run: tracking.StageRun, inputs: dict[str, Any], name: str, lock_path: str | Path,
                 dataset_paths: dict[str, tuple[str, str]]) -> list[dict[str, str]]:
    """Params, tags, dataset inputs and hypothesis/metrics artifacts of the register run."""
    bleu = inputs["bleu"]
    datasets = dvc_datasets(lock_path, dataset_paths)
    registry.log_datasets(run, datasets)
    run.log_params({"register.model_name": name, "register.alias": ALIAS, "register.beam_size": bleu["beam"],
                    "register.alpha": bleu["alpha"], "register.bootstrap_samples": BOOTSTRAP_SAMPLES})
    run.set_tags({"evaluate_run_id": bleu["evaluate_run_id"] or "", "sacrebleu_signature": bleu["signature"],
                  "averaged_sha256": inputs["averaged_sha256"],
                  **{f"dataset.{d['name']}.md5": d["digest"] for d in datasets},
                  **{f"{s}_ref_sha256": inputs["ref_sha"][s] for s in SPLITS}})
    for split in SPLITS:
        run.log_artifact(inputs["hyps"][split], HYPS_ARTIFACT_DIR)
    return datasets


def _record_only(name: str, new: dict[str, Any], decision: str, *, existing: dict[str, Any] | None = None,
                 holder: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record of a run that logs nothing (tracking off, or this model already registered)."""
    record = {"tracking": "on" if tracking.enabled() else "off", "model_name": name, "alias": ALIAS,
              "alias_moved": False, "decision": decision, "new": new,
              "mlflow_run_id": existing["run_id"] if existing else None,
              "model_version": existing["version"] if existing else None,
              "candidate_version": holder["version"] if holder else None}
    log.info("register: %s", decision)
    return record


def _log_decision(run: tracking.StageRun, record: dict[str, Any]) -> None:
    """BLEU of both models, the p-value and the decision, as metrics and tags of the register run."""
    new, previous, bootstrap = record["new"], record["previous_candidate"] or {}, record["paired_bootstrap"]
    metrics = {"valid_bleu": new["valid_bleu"], "test_bleu": new["test_bleu"],
               "alias_moved": int(record["alias_moved"])}
    if bootstrap:
        metrics.update(paired_bs_p_value=bootstrap["p_value"], candidate_test_bleu=bootstrap["candidate_bleu"])
    if "valid_bleu" in previous:
        metrics["candidate_valid_bleu"] = previous["valid_bleu"]
    run.log_metrics(metrics)
    run.set_tags({"register.decision": record["decision"], "register.alias_moved": str(record["alias_moved"]).lower(),
                  "register.model_version": record["model_version"]})


def stage(cfg: EvaluateConfig, *, model_dir: str | Path, eval_dir: str | Path, raw_dir: str | Path,
          bleu_path: str | Path, lock_path: str | Path = "dvc.lock",
          dataset_paths: dict[str, tuple[str, str]] | None = None, root: str | Path = ".") -> dict[str, Any]:
    """Log and register the averaged model; move ``candidate`` if it wins on valid BLEU.

    Args:
        cfg: the ``evaluate`` section (the served model decodes with its length and batch limits).
        model_dir: ``paths.model`` holding ``averaged.pt``.
        eval_dir: ``paths.eval`` holding ``{valid,test}.hyp.de``.
        raw_dir: ``paths.raw`` holding the references ``{valid,test}.de``.
        bleu_path: evaluate's ``evaluate.details.json`` (valid/test BLEU, chosen beam and α).
        lock_path: ``dvc.lock`` (dataset md5s).
        dataset_paths: dataset name → (DVC out path, MLflow context) to record as inputs.
        root: repository root (default MLflow store).

    Returns:
        The decision record: run id, version, decision, p-value and both BLEUs.

    Raises:
        CheckpointError, DataError: missing or inconsistent inputs (nothing is logged then).
    """
    inputs = _inputs(model_dir, eval_dir, raw_dir, bleu_path)
    name, bleu = model_name(), inputs["bleu"]
    new = {"valid_bleu": bleu["valid_bleu"], "test_bleu": bleu["test_bleu"], "beam": bleu["beam"],
           "alpha": bleu["alpha"]}
    if not tracking.enabled():
        return _record_only(name, new, "tracking is off (NMT_TRACKING=off): nothing logged or "
                            "registered; `dvc repro -f register` with tracking on to register this model")
    holder = registry.alias_holder(name, ALIAS, root)
    same = registry.find_model_versions(name, {"averaged_sha256": inputs["averaged_sha256"], "beam": bleu["beam"],
                                               "alpha": bleu["alpha"]}, root)
    if same:
        return _record_only(name, new, f"this averaged.pt with beam {bleu['beam']}, alpha "
                            f"{bleu['alpha']} is already version {same[0]['version']}: not logged again",
                            existing=same[0], holder=holder)
    run = tracking.current()
    with tempfile.TemporaryDirectory(prefix="nmt-register-") as tmp:
        work = Path(tmp)
        datasets = _log_lineage(run, inputs, name, lock_path, dataset_paths or {})
        info = _log_model(run, cfg, inputs, name, work, root)
        version = info["version"]
        registry.tag_model_version(name, version, {"run_id": run.run_id, **new,
                                                   "averaged_sha256": inputs["averaged_sha256"],
                                                   **{f"{s}_ref_sha256": inputs["ref_sha"][s] for s in SPLITS}}, root)
        bootstrap, not_compared = _compare(holder, inputs, work, root)
        moved, decision = decide(bleu["valid_bleu"], inputs["ref_sha"], holder)
        if moved:
            registry.set_alias(name, ALIAS, version, root)
        previous = None if holder is None else {
            "version": holder["version"], "run_id": holder["run_id"],
            **{k: float(holder["tags"][k]) for k in ("valid_bleu", "test_bleu") if k in holder["tags"]}}
        record = {"tracking": "on", "model_name": name, "alias": ALIAS, "alias_moved": moved, "decision": decision,
                  "mlflow_run_id": run.run_id, "model_version": version, "model_uri": info["model_uri"],
                  "registered_uri": f"models:/{name}/{version}", "new": new, "previous_candidate": previous,
                  "candidate_version": version if moved else (holder or {}).get("version"),
                  "paired_bootstrap": bootstrap, "paired_bootstrap_skipped": not_compared,
                  "datasets": [{k: d[k] for k in ("name", "digest", "context")} for d in datasets]}
        _log_decision(run, record)
    log.info("registered %s version %s (%s); alias %s %s", name, version, decision, ALIAS,
             "moved" if moved else "kept")
    return record


def _run(params: Params, args: argparse.Namespace) -> dict:
    paths = params.paths
    return stage(params.evaluate, model_dir=paths.model, eval_dir=paths.eval, raw_dir=paths.raw,
                 bleu_path=stages.details_file(paths.metrics, "evaluate"),
                 dataset_paths={"raw": (paths.raw, "source"), "bpe": (paths.bpe, "training"),
                                "shards": (paths.shards, "training")})


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.register``."""
    return stage_main("register", _run, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Whether a new model becomes the ``candidate`` (the register stage's work): its inputs checked, the pyfunc logged
with its lineage, the paired bootstrap against the candidate, and the decision."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TypedDict

import yaml

from pipeline.artifacts import model_file
from pipeline.core import env
from pipeline.core.config import EvaluateConfig
from pipeline.core.details import EvaluateDetails, RegisterDetails, read_json
from pipeline.core.errors import CheckpointError, DataError
from pipeline.core.stages import DvcLock, LockFile
from pipeline.core.textio import read_lines, sha256_file
from pipeline.inference import ct2
from pipeline.tracking import model_registry
from pipeline.tracking.model_registry import LoggedModel, ModelVersion
from pipeline.tracking.runs import StageRun

log = logging.getLogger(__name__)

ALIAS = "candidate"
HYPS_ARTIFACT_DIR = "hyps"
BOOTSTRAP_SAMPLES = 1000
MODEL_FILE = Path(__file__).resolve().with_name("pyfunc.py")
#: what the served model imports (versions pinned from this environment).
REQUIREMENTS = ("mlflow", "torch", "sentencepiece", "numpy", "pandas", "pyyaml", "ctranslate2")
SPLITS = ("valid", "test")
#: The source lines logged as the model's input example (what ``mlflow models predict`` and the UI show).
INPUT_EXAMPLE = ["A man is riding a bicycle."]
#: Packages copied whole into the logged model (so it loads anywhere): their files are register's code deps.
CODE_PACKAGES = ("pipeline", "model")


@dataclass(frozen=True)
class Evaluation:
    """What register takes from evaluate's ``evaluate.details.json``."""

    valid_bleu: float
    test_bleu: float
    beam: int
    alpha: float
    signature: str  # sacreBLEU's, of the test BLEU
    evaluate_run_id: str | None


class Bootstrap(TypedDict):
    """sacreBLEU's paired bootstrap of the new model against the candidate (:func:`paired_bootstrap`)."""

    p_value: float
    n_samples: int
    signature: str
    identical_hypotheses: bool
    new_bleu: float
    new_mean: float
    new_ci: float
    candidate_bleu: float
    candidate_mean: float
    candidate_ci: float


@dataclass(frozen=True)
class Inputs:
    """The register stage's inputs, checked: the model file, evaluate's figures, hypotheses and references."""

    averaged: Path
    averaged_sha256: str
    evaluation: Evaluation
    hyps: dict[str, Path]  # split -> <eval>/<split>.hyp.de
    refs: dict[str, Path]  # split -> <raw>/<split>.de
    ref_sha: dict[str, str]  # split -> sha256 of refs[split]


def read_evaluation(path: str | Path) -> Evaluation:
    """The figures register needs from evaluate's ``evaluate.details.json``.

    Raises:
        PipelineError/DataError: missing file, bad JSON, a missing or mistyped key (named, with the remedy).
    """
    report = EvaluateDetails.from_json(read_json(path), str(path))
    needed = {"valid.bleu": report.valid.bleu, "test.bleu": report.test.bleu, "chosen.beam": report.chosen.beam,
              "chosen.alpha": report.chosen.alpha}
    missing = [key for key, value in needed.items() if value is None]
    if missing:
        raise DataError(f"{path}: lacks {', '.join(missing)} (needs {', '.join(needed)}); rerun `dvc repro evaluate`")
    return Evaluation(valid_bleu=report.valid.bleu, test_bleu=report.test.bleu, beam=report.chosen.beam,
                      alpha=report.chosen.alpha, signature=report.test.signatures.get("bleu", ""),
                      evaluate_run_id=report.mlflow_run_id)


def gather_inputs(model_dir: str | Path, eval_dir: str | Path, raw_dir: str | Path, bleu_path: str | Path) -> Inputs:
    """Check and gather the stage's inputs before anything is logged.

    Raises:
        CheckpointError: no ``averaged.pt``. DataError: a hypothesis or reference file missing or of another
            line count; bad ``evaluate.details.json``.
    """
    averaged = model_file.path_in(model_dir)
    if not averaged.is_file():
        raise CheckpointError(f"{averaged}: not found; run `dvc repro average`")
    model_file.verify(averaged)  # with tracking off nothing else reads it: a changed file is refused here too
    evaluation = read_evaluation(bleu_path)
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
    return Inputs(averaged=averaged, averaged_sha256=sha256_file(averaged), evaluation=evaluation, hyps=hyps,
                  refs=refs, ref_sha={s: sha256_file(refs[s]) for s in SPLITS})


def dvc_datasets(lock_path: str | Path, wanted: dict[str, tuple[str, str]]) -> list[dict[str, str]]:
    """One ``{"name", "digest" (DVC md5), "source", "context"}`` per ``wanted`` dataset (name → (dvc.yaml out path,
    MLflow context)) in ``dvc.lock`` (none, with a warning, without one; DataError when it is not valid YAML)."""
    lock_path = Path(lock_path)
    if not lock_path.is_file():
        log.warning("%s not found: dataset inputs are not recorded (run the pipeline with dvc repro)", lock_path)
        return []
    try:
        lock: DvcLock = yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = (getattr(exc, "problem", None) or str(exc).splitlines()[0]) + (
            f" at line {mark.line + 1}" if mark is not None else "")
        raise DataError(f"{lock_path}: not valid YAML ({problem}); restore it with `git checkout dvc.lock`") from None
    found: dict[str, tuple[str, LockFile]] = {}
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


def paired_bootstrap(new_hyps: list[str], candidate_hyps: list[str], refs: list[str]) -> Bootstrap:
    """sacreBLEU's paired bootstrap (BLEU 13a cased, the candidate as baseline): both BLEUs, their bootstrap means
    and confidence intervals, and ``p_value``, the chance of a BLEU difference at least this large.

    Raises:
        DataError: the three line lists differ in length.
    """
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    if not len(new_hyps) == len(candidate_hyps) == len(refs):
        raise DataError(f"paired bootstrap needs equal lengths: new {len(new_hyps)}, candidate "
                        f"{len(candidate_hyps)}, references {len(refs)} lines")
    test = PairedTest([("candidate", candidate_hyps), ("new", new_hyps)], {"BLEU": BLEU(tokenize="13a")},
                      references=[refs], test_type="bs", n_samples=BOOTSTRAP_SAMPLES)
    signatures, scores = test()
    (metric,) = (k for k in scores if k != "System")
    baseline, system = scores[metric]
    # Note: sacreBLEU gives p = 1/(n+1) for two identical systems (a zero difference is never "by chance").
    return Bootstrap(p_value=float(system.p_value), n_samples=BOOTSTRAP_SAMPLES, signature=signatures[metric].format(),
                     identical_hypotheses=list(new_hyps) == list(candidate_hyps),
                     new_bleu=float(system.score), new_mean=float(system.mean), new_ci=float(system.ci),
                     candidate_bleu=float(baseline.score), candidate_mean=float(baseline.mean),
                     candidate_ci=float(baseline.ci))


def decide(new_valid: float, new_refs: dict[str, str], holder: ModelVersion | None) -> tuple[bool, str]:
    """Whether ``candidate`` moves to the new version, and why (valid BLEU only; the test set never chooses)."""
    if holder is None:
        return True, "no version held the alias before this one"
    tags = holder.tags
    if tags.get("valid_ref_sha256") != new_refs["valid"]:
        return False, (f"version {holder.version} was scored against other valid references (another dataset or "
                       "profile): not comparable; set NMT_MODEL_NAME to register this model under its own name")
    try:
        old_valid = float(tags["valid_bleu"])
    except (KeyError, ValueError):
        return False, (f"version {holder.version} has no valid_bleu tag: cannot compare; move the alias by hand "
                       "if this model should replace it")
    if new_valid > old_valid:
        return True, f"valid BLEU {new_valid:.2f} > {old_valid:.2f} of version {holder.version}"
    return False, f"valid BLEU {new_valid:.2f} <= {old_valid:.2f} of version {holder.version}"


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
    dirs = []
    for name in CODE_PACKAGES:
        package = Path(importlib.import_module(name).__file__).resolve().parent
        dst = work / "code" / package.name
        shutil.copytree(package, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        dirs.append(str(dst))
    return dirs


def log_model(run: StageRun, cfg: EvaluateConfig, inputs: Inputs, name: str, work: Path,
              root: str | Path) -> LoggedModel:
    """Log and register the pyfunc translator (with a CTranslate2 export if ``NMT_REGISTER_CTRANSLATE2`` asks)."""
    spm_path = work / "spm.model"
    spm_path.write_bytes(model_file.load(inputs.averaged, mmap=True).spm)
    chosen = inputs.evaluation
    artifacts = {"averaged": str(inputs.averaged), "spm": str(spm_path)}
    model_config: dict[str, int | float | str] = {
        "beam_size": chosen.beam, "alpha": chosen.alpha, "max_len_a": cfg.max_len_a, "max_len_b": cfg.max_len_b,
        "max_tokens": cfg.max_tokens, "engine": "torch"}
    quantization = env.settings().register_ctranslate2
    if quantization != "off":
        artifacts["ctranslate2"] = str(ct2.export(inputs.averaged, work / "ctranslate2", quantization))
        model_config["engine"] = "ctranslate2"
    info = model_registry.log_pyfunc_model(
        run, python_model=MODEL_FILE, artifacts=artifacts, code_paths=_code_copies(work), model_config=model_config,
        params={"beam_size": chosen.beam, "alpha": chosen.alpha, "engine": model_config["engine"]},
        registered_model_name=name, pip_requirements=_requirements(), input_example=INPUT_EXAMPLE, root=root)
    assert info is not None and info.version is not None  # tracking is on here
    return info


def compare(holder: ModelVersion | None, inputs: Inputs, work: Path,
            root: str | Path) -> tuple[Bootstrap | None, str | None]:
    """Paired bootstrap of the new vs the candidate's test hypotheses, or (None, why it was not run)."""
    if holder is None:
        return None, "no candidate to compare with"
    if holder.tags.get("test_ref_sha256") != inputs.ref_sha["test"]:
        return None, f"version {holder.version} was scored against other test references"
    fetched = None
    if holder.run_id:
        fetched = model_registry.download_run_artifact(holder.run_id, f"{HYPS_ARTIFACT_DIR}/test.hyp.de",
                                                       work / "candidate", root)
    if fetched is None:
        return None, f"version {holder.version}'s run has no {HYPS_ARTIFACT_DIR}/test.hyp.de artifact"
    result = paired_bootstrap(list(read_lines(inputs.hyps["test"])), list(read_lines(fetched)),
                              list(read_lines(inputs.refs["test"])))
    log.info("paired bootstrap on test vs version %s: BLEU %.2f vs %.2f, p = %.4f", holder.version,
             result["new_bleu"], result["candidate_bleu"], result["p_value"])
    return result, None


def log_lineage(run: StageRun, inputs: Inputs, name: str, lock_path: str | Path,
                dataset_paths: dict[str, tuple[str, str]]) -> list[dict[str, str]]:
    """Params, tags, dataset inputs and hypothesis artifacts of the register run; returns the datasets."""
    chosen = inputs.evaluation
    datasets = dvc_datasets(lock_path, dataset_paths)
    model_registry.log_datasets(run, datasets)
    run.log_params({"register.model_name": name, "register.alias": ALIAS, "register.beam_size": chosen.beam,
                    "register.alpha": chosen.alpha, "register.bootstrap_samples": BOOTSTRAP_SAMPLES})
    run.set_tags({"evaluate_run_id": chosen.evaluate_run_id or "", "sacrebleu_signature": chosen.signature,
                  "averaged_sha256": inputs.averaged_sha256,
                  **{f"dataset.{d['name']}.md5": d["digest"] for d in datasets},
                  **{f"{s}_ref_sha256": inputs.ref_sha[s] for s in SPLITS}})
    for split in SPLITS:
        run.log_artifact(inputs.hyps[split], HYPS_ARTIFACT_DIR)
    return datasets


def log_decision(run: StageRun, record: RegisterDetails, chosen: Evaluation, bootstrap: Bootstrap | None,
                 holder: ModelVersion | None) -> None:
    """BLEU of both models, the p-value and the decision (the stage's record), as metrics and tags of the run."""
    moved = bool(record.alias_moved)
    metrics = {"valid_bleu": chosen.valid_bleu, "test_bleu": chosen.test_bleu, "alias_moved": int(moved)}
    if bootstrap:
        metrics.update(paired_bs_p_value=bootstrap["p_value"], candidate_test_bleu=bootstrap["candidate_bleu"])
    if holder is not None and "valid_bleu" in holder.tags:
        metrics["candidate_valid_bleu"] = float(holder.tags["valid_bleu"])
    run.log_metrics(metrics)
    run.set_tags({"register.decision": record.decision, "register.alias_moved": str(moved).lower(),
                  "register.model_version": record.model_version})

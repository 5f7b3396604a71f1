"""Stage ``audit``: this run beside the paper's base model, item by item, with its lineage.

Writes ``<paths.reports>/audit.md`` (for people) and ``audit.json`` (the same content, sorted keys,
no timestamps beyond those in the inputs). Every item gets a verdict: ``matches``, ``deviates``
(the deviation named, e.g. ``model.pre_norm = true (paper: post-norm)``) or ``not measured``
(its input does not exist yet: the audit never needs the whole pipeline to have run). A file
that exists but is malformed is an error naming it.

Inputs: params.yaml, ``profiles/paper.yaml`` (to name every key a profile changes), the stages'
metrics JSON, the raw and shards manifests, the newest checkpoint's ``state.json``,
``averaged.pt`` (parameter count), ``dvc.lock`` (read, not a dependency: DVC rewrites it when this
stage runs) and git. The paper's figures live in :mod:`pipeline.audit_paper` with their sources.
The replay items (:mod:`pipeline.audit_replay`) also read the hypothesis files, the valid/test
references and the previous ``audit.json``.

The stage logs itself as MLflow child run ``audit`` (both reports as artifacts, the verdict counts,
parameter count and test BLEU as metrics) and writes that run id to ``<paths.metrics>/audit.json``,
never into the report, which stays a function of its inputs.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from pipeline.audit_paper import BLEU_GAP, NEUTRAL_KEYS, PAPER, PAPER_SETTINGS, bleu_figures, fmt, measured_items
from pipeline.config import Params, flatten, section_dict
from pipeline.errors import CheckpointError, DataError, PipelineError
from pipeline.stage import read_json, run_cli, stage_parser, write_metrics
from pipeline.textio import atomic_path, sha256_file

log = logging.getLogger(__name__)

FORMAT = 1
METRICS = ("download", "clean", "bpe", "encode", "train", "average", "bleu")
PAPER_PROFILE = Path("profiles") / "paper.yaml"


@dataclass
class Inputs:
    """Everything the audit reads; ``None`` marks an input that does not exist (yet)."""

    params: dict[str, Any]
    params_sha256: str
    paper_profile: dict[str, Any] | None
    metrics: dict[str, dict[str, Any] | None]
    raw_manifest: dict[str, Any] | None
    shards_manifest: dict[str, Any] | None
    shards_manifest_sha256: str | None
    state: dict[str, Any] | None
    state_path: str | None
    model: dict[str, Any] | None
    lock: dict[str, Any] | None
    git: dict[str, Any]
    environment: dict[str, Any] = field(default_factory=dict)
    replay: dict[str, Any] = field(default_factory=dict)


def read_optional_json(path: Path) -> dict[str, Any] | None:
    """A JSON object, or None when the file does not exist.

    Raises:
        PipelineError: the file exists but is not valid JSON or not an object (names the file).
    """
    if not path.is_file():
        return None
    data = read_json(path)
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(data).__name__}; "
                        "delete it and rerun the stage that writes it")
    return data


def read_yaml(path: Path) -> dict[str, Any] | None:
    """A YAML mapping, or None when the file does not exist.

    Raises:
        PipelineError: the file exists but is not a valid YAML mapping (names the file).
    """
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path}: not valid YAML ({exc}); restore it from git or rerun `dvc repro`") from None
    if not isinstance(data, dict):
        raise PipelineError(f"{path}: expected a YAML mapping, got {type(data).__name__}")
    return data



def count_parameters(path: Path) -> dict[str, Any] | None:
    """Parameter statistics of ``averaged.pt`` (floating tensors; a tensor shared by two keys counts once).

    Returns:
        None if the file does not exist, else ``{"total", "embedding", "tied", "learned_positions",
        "vocab_size", "d_model"}``.

    Raises:
        CheckpointError: unreadable file or not the average stage's format (names the file).
    """
    if not path.is_file():
        return None
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/UnpicklingError/EOFError...
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}); rerun `dvc repro average`") from None
    state = obj.get("model") if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: no 'model' state_dict; was it written by the average stage?")
    seen, total = set(), 0
    for tensor in state.values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.is_floating_point() and key not in seen:
            seen.add(key)
            total += tensor.numel()
    embed = state.get("embed.weight")
    shape = tuple(embed.shape) if embed is not None else None
    same_shape = sum(1 for v in state.values() if shape is not None and tuple(v.shape) == shape)
    return {"total": total, "embedding": int(embed.numel()) if embed is not None else 0,
            "tied": embed is not None and same_shape == 1,
            "learned_positions": any("position" in k for k in state),
            "vocab_size": shape[0] if shape else None, "d_model": shape[1] if shape else None}


def git_state(root: Path) -> dict[str, Any]:
    """Commit and dirty flag of ``root`` (tracked files; dvc.lock ignored: DVC rewrites it mid-run)."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                                  timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None, "dirty_paths": []}
    status = git("status", "--porcelain", "--untracked-files=no") or ""
    paths = sorted(line[3:] for line in status.splitlines() if line[3:] and line[3:] != "dvc.lock")
    return {"commit": commit.strip(), "dirty": bool(paths), "dirty_paths": paths}


def environment(metrics: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Versions of the audit's environment and the devices the stages recorded."""
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    train, bleu = metrics.get("train") or {}, metrics.get("bleu") or {}
    return {"python": platform.python_version(), "torch": version("torch"), "sacrebleu": version("sacrebleu"),
            "sentencepiece": version("sentencepiece"), "dvc": version("dvc"), "mlflow": version("mlflow"),
            "train_device": train.get("device"), "train_device_name": train.get("device_name"),
            "train_world_size": train.get("world_size"), "evaluate_device": bleu.get("device")}


def previous_replay(path: Path | None) -> dict[str, Any] | None:
    """The ``replay`` section of the previous ``audit.json`` (None if absent, unreadable or of another format)."""
    if path is None or not path.is_file():
        return None
    try:
        data = read_optional_json(path)
    except PipelineError as exc:  # the audit's own output, replaced by this run: not worth failing for
        log.warning("ignoring the previous audit: %s", exc)
        return None
    section = (data or {}).get("replay")
    return section if isinstance(section, dict) else None


def load_inputs(params: Params, *, params_file: Path, lock_file: Path, root: Path,
                previous_audit: Path | None = None) -> Inputs:
    """Read every input the audit uses (missing ones become None; malformed ones raise, naming the file).

    ``previous_audit`` is the audit.json this run replaces (its replay record is compared with now).
    """
    from pipeline import checkpoint
    from pipeline.audit_replay import replay

    paths = params.paths
    raw_params = section_dict(params)
    metrics = {name: read_optional_json(root / paths.metrics / f"{name}.json") for name in METRICS}
    shards_manifest_path = root / paths.shards / "manifest.json"
    newest = checkpoint.latest(root / paths.train)
    state_path = newest / checkpoint.STATE if newest is not None else None
    state = read_optional_json(state_path) if state_path is not None else None
    profile_file = root / PAPER_PROFILE
    if not profile_file.is_file():  # a workspace without profiles/: use the one beside this code
        profile_file = Path(__file__).resolve().parents[1] / PAPER_PROFILE
    lock = read_yaml(lock_file)
    return Inputs(
        params=raw_params, params_sha256=sha256_file(params_file), paper_profile=read_yaml(profile_file),
        metrics=metrics, raw_manifest=read_optional_json(root / paths.raw / "manifest.json"),
        shards_manifest=read_optional_json(shards_manifest_path),
        shards_manifest_sha256=sha256_file(shards_manifest_path) if shards_manifest_path.is_file() else None,
        state={k: v for k, v in state.items() if k != "history"} if state else None,
        state_path=str(Path(paths.train) / newest.name / checkpoint.STATE) if newest is not None else None,
        model=count_parameters(root / paths.model / "averaged.pt"), lock=lock,
        git=git_state(root), environment=environment(metrics),
        replay=replay(params=raw_params, bleu=metrics["bleu"], lock=lock, root=root,
                      previous=previous_replay(previous_audit)))


def configuration_items(params: dict[str, Any]) -> list[dict[str, Any]]:
    """One item per paper setting (Table 3 and §3-§6), from the params."""
    flat = flatten(params)
    return [setting.check(flat) for setting in PAPER_SETTINGS]


def profile_differences(params: dict[str, Any], paper_profile: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every params key whose value differs from ``profiles/paper.yaml``, each classified.

    ``kind`` is ``paper`` (a paper setting: also a configuration item), ``unspecified`` (the paper
    is silent but results change) or ``operational`` (paths, logging, retries: results do not change).
    """
    if paper_profile is None:
        return []
    flat, ref = flatten(params), flatten(paper_profile)
    paper_keys = {key for setting in PAPER_SETTINGS for key in setting.keys}
    out = []
    for key in sorted(set(flat) | set(ref)):
        if key in flat and key in ref and flat[key] == ref[key]:
            continue
        neutral = key in NEUTRAL_KEYS or key.split(".")[0] in NEUTRAL_KEYS
        kind = "paper" if key in paper_keys else "operational" if neutral else "unspecified"
        out.append({"key": key, "paper_profile": ref.get(key), "run": flat.get(key), "kind": kind,
                    "deviation": f"{key} = {fmt(flat.get(key))} (paper profile: {fmt(ref.get(key))})"})
    return out


def lineage(inp: Inputs) -> dict[str, Any]:
    """dvc.lock hashes per stage, the manifests' sha256s, params.yaml, git and MLflow run ids."""
    from pipeline.runner import stage_lock_md5

    stages = {}
    for name, entry in ((inp.lock or {}).get("stages") or {}).items():
        stages[name] = {"cmd": entry.get("cmd"), "lock_md5": stage_lock_md5(inp.lock, name),
                        "deps": [{"path": d.get("path"), "md5": d.get("md5")} for d in entry.get("deps") or []],
                        "outs": [{"path": o.get("path"), "md5": o.get("md5")} for o in entry.get("outs") or []]}
    raw = inp.raw_manifest
    shards = inp.shards_manifest
    run_ids = {name: m.get("mlflow_run_id") for name, m in inp.metrics.items() if m is not None}
    if inp.state is not None:
        run_ids["train (state.json)"] = inp.state.get("mlflow_run_id")
    return {
        "params_sha256": inp.params_sha256, "git": inp.git, "dvc_lock": stages if inp.lock is not None else None,
        "raw_manifest": None if raw is None else {
            "dataset": raw.get("dataset"),
            "files": [{k: f.get(k) for k in ("split", "lang", "url", "member", "sha256", "bytes", "lines")}
                      for f in raw.get("files") or []],
            "outputs": raw.get("outputs")},
        "shards_manifest": None if shards is None else {
            "sha256": inp.shards_manifest_sha256, "spm_sha256": shards.get("spm_sha256"),
            "vocab_size": shards.get("vocab_size"),
            "splits": {split: {"rows": info.get("rows"), "shards": [{k: s.get(k) for k in ("path", "rows", "sha256")}
                                                                     for s in info.get("shards") or []]}
                       for split, info in (shards.get("splits") or {}).items()}},
        "checkpoint_state": inp.state_path, "mlflow_run_ids": run_ids,
    }


def build_audit(inp: Inputs) -> dict[str, Any]:
    """The whole audit as one JSON-able mapping (the markdown is rendered from it)."""
    config = configuration_items(inp.params)
    diffs = profile_differences(inp.params, inp.paper_profile)
    measured = measured_items(inp)
    deviations = [i["deviation"] for i in config if i["verdict"] == "deviates"]
    deviations += [f"{i['item']}: {i['deviation']}" for i in measured if i["verdict"] == "deviates"]
    deviations += [d["deviation"] for d in diffs if d["kind"] == "unspecified"]
    replayed = inp.replay.get("items", [])
    deviations += [f"{i['item']}: {i['deviation']}" for i in replayed if i["verdict"] == "deviates"]
    items = config + measured + replayed
    summary = {v: sum(1 for i in items if i["verdict"] == v) for v in ("matches", "deviates", "not measured")}
    return {"format": FORMAT, "profile": inp.params.get("profile"), "dataset": (inp.params.get("download") or {})
            .get("dataset"), "summary": summary, "configuration": config, "measured": measured,
            "profile_differences": diffs, "deviations": deviations, "bleu_gap": BLEU_GAP, "paper": PAPER,
            "bleu_figures": bleu_figures(inp.metrics.get("bleu")), "replay": inp.replay,
            "lineage": lineage(inp), "environment": inp.environment}


def tracking_metrics(audit: dict[str, Any], inp: Inputs) -> dict[str, float]:
    """The numbers the audit logs to MLflow: verdict counts, parameter count, test BLEU, replay outcome."""
    summary, out = audit["summary"], {}
    out.update(matches=summary["matches"], deviates=summary["deviates"], not_measured=summary["not measured"])
    parameters = inp.model["total"] if inp.model else (inp.metrics.get("average") or {}).get("parameters")
    if parameters is not None:
        out["parameters"] = int(parameters)
    for f in audit["bleu_figures"]:
        if f["set"] == "test" and f["metric"] in ("bleu", "bleu_tok_split"):
            out[f"test_{f['metric']}"] = f["score"]
    replayed = [i for i in audit["replay"].get("items", []) if i["verdict"] != "not measured"]
    if replayed:
        out["replay_identical"] = float(all(i["verdict"] == "matches" for i in replayed))
    return out


def stage(params: Params, *, params_file: str | Path, lock_file: str | Path, root: str | Path,
          md_path: str | Path, json_path: str | Path, metrics_path: str | Path | None = None) -> dict[str, Any]:
    """Write the replication audit (``audit.md`` and ``audit.json``, both atomically) and log it to MLflow.

    Args:
        params: the loaded params (``paths`` says where every input lives, relative to ``root``); they
            are compared with the paper, profiles/paper.yaml and the params dvc.lock recorded.
        params_file: the params.yaml they were loaded from (its sha256 goes into the lineage).
        lock_file: ``dvc.lock`` (optional: without it lineage is "not measured").
        root: the workspace the ``paths`` are relative to (git is asked there).
        md_path: ``audit.md``. json_path: ``audit.json`` (an existing one is the previous audit the
            replay compares with before it is replaced).
        metrics_path: the stage's metrics JSON (MLflow run id, verdict counts); None writes none.

    Returns:
        The audit mapping written to ``json_path``.

    Raises:
        PipelineError: an input exists but is malformed (names the file).
    """
    from pipeline.audit_render import render_markdown
    from pipeline.tracking import stage_run

    inp = load_inputs(params, params_file=Path(params_file), lock_file=Path(lock_file), root=Path(root),
                      previous_audit=Path(json_path))
    audit = build_audit(inp)
    text_json = json.dumps(audit, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    text_md = render_markdown(audit)
    numbers = tracking_metrics(audit, inp)
    with stage_run("audit", root=root) as run:
        with atomic_path(json_path) as tmp_json, atomic_path(md_path) as tmp_md:
            tmp_json.write_text(text_json, encoding="utf-8")
            tmp_md.write_text(text_md, encoding="utf-8")
        run.log_metrics(numbers)
        run.set_tags({"profile": audit["profile"], "dataset": audit["dataset"],
                      "audit_json_sha256": sha256_file(json_path)})
        run.log_artifact(md_path)
        run.log_artifact(json_path)
        if metrics_path is not None:
            write_metrics(metrics_path, {**numbers, "mlflow_run_id": run.run_id, "report": str(json_path),
                                         "report_sha256": sha256_file(json_path)})
    log.info("audit: %d match, %d deviate, %d not measured -> %s", audit["summary"]["matches"],
             audit["summary"]["deviates"], audit["summary"]["not measured"], md_path)
    return audit


def _body(params: Params, args: argparse.Namespace) -> None:
    root = Path(args.root)
    reports = root / params.paths.reports
    stage(params, params_file=args.params, lock_file=args.lock, root=root, md_path=reports / "audit.md",
          json_path=reports / "audit.json", metrics_path=root / params.paths.metrics / "audit.json")


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.audit [--params params.yaml] [--lock dvc.lock] [--root .]``."""
    parser = stage_parser("replication audit: this run beside the paper's base model, with lineage")
    parser.add_argument("--lock", default="dvc.lock", help="dvc.lock to read lineage from (default: dvc.lock)")
    parser.add_argument("--root", default=".", help="workspace the params paths are relative to (default: .)")
    return run_cli("audit", _body, argv, parser)


if __name__ == "__main__":
    sys.exit(main())

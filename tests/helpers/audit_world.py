"""The audit stage's world: a tiny run made by the real stages (clean → bpe → encode → train → average →
evaluate) on raw text written as the download stage writes it, with a stand-in dvc.lock.

:func:`build_audit_world` is what the ``audit_world`` fixture (tests/conftest.py) returns;
:func:`synthetic_inputs` gives the audit's inputs without running anything.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from pipeline.auditing.inputs import Inputs
from pipeline.average import stage as average_stage
from pipeline.bpe import stage as bpe_stage
from pipeline.clean import stage as clean_stage
from pipeline.core import stages
from pipeline.core.config import BpeConfig, Params, checkpoint_folder, params_from_dict
from pipeline.core.details import RECORDS, RunDetails
from pipeline.core.owned import write_lines, write_text
from pipeline.encode import stage as encode_stage
from pipeline.evaluate import stage as evaluate_stage
from pipeline.project.profiles import merged_profile
from pipeline.tracking.harness import run_stage, write_metrics
from pipeline.train import stage as train_stage
from tests.helpers.eval_world import TEST, VALID
from tests.helpers.models import CORPUS
from tests.helpers.paths import REPO

PATHS = {name: f"data/{name}" for name in ("raw", "clean", "bpe", "shards", "train", "model", "eval", "metrics",
                                          "plots", "reports")}


def profile_params(name: str, root: Path, sizes: dict[str, dict] | None = None) -> tuple[dict, Params, Path]:
    """Profile ``name`` with every path relative to ``root`` and its sections updated by ``sizes``, written as
    ``root/params.yaml``."""
    data = merged_profile(name, REPO)
    data["paths"] = dict(PATHS)
    for section, values in (sizes or {}).items():
        data[section].update(values)
    path = root / "params.yaml"
    write_text(path, yaml.safe_dump(data, sort_keys=False))
    return data, params_from_dict(data), path


def _raw(root: Path) -> None:
    """Raw text plus the manifest and download's metrics exactly as the download stage writes them."""
    pairs = {"train": [(f"{en} {i}", f"{de} {i}") for i in range(8) for de, en in zip(CORPUS[0:13:2], CORPUS[1:13:2])],
             "valid": VALID, "test": TEST}
    files, outputs = [], {}
    for split, rows in pairs.items():
        for side, lang in ((0, "en"), (1, "de")):
            path = root / "data" / "raw" / f"{split}.{lang}"
            write_lines(path, [r[side] for r in rows])
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            outputs[path.name] = {"sha256": sha, "bytes": path.stat().st_size, "lines": len(rows)}
            files.append({"split": split, "corpus": f"toy-{split}", "lang": lang, "url": f"https://example.org/{split}."
                          f"{lang}.gz", "member": None, "format": "gzip", "sha256": sha[::-1], "bytes": 100 + side,
                          "lines": len(rows)})
    (root / "data" / "raw" / "manifest.json").write_text(json.dumps({"dataset": "multi30k", "files": files,
                                                            "outputs": outputs}, indent=2, sort_keys=True) + "\n")
    (root / "data" / "metrics").mkdir()
    record = {"archives": {}, "dataset": "multi30k", "mlflow_run_id": None, "origins": {},
              "pairs": {s: len(r) for s, r in pairs.items()}, "seconds": 0.1}
    write_metrics(stages.details_file(root / "data" / "metrics", "download"), record)


def _dvc_lock(root: Path, data: dict) -> None:
    """A dvc.lock in DVC 3's format (stage params = the params.yaml sections, md5 per dep/out)."""
    def entry(deps: list[str], outs: list[str], sections: list[str]) -> dict:
        md5 = lambda p: hashlib.md5(p.encode()).hexdigest()  # stand-in digests
        return {"cmd": "python -m pipeline.x", "deps": [{"path": p, "hash": "md5", "md5": md5(p), "size": 1}
                                                        for p in deps],
                "params": {"params.yaml": {s: copy.deepcopy(data[s]) for s in sections}},
                "outs": [{"path": p, "hash": "md5", "md5": md5(p) + ".dir", "size": 2, "nfiles": 3} for p in outs]}
    lock = {"schema": "2.0", "stages": {
        "download": entry(["pipeline/download.py"], ["data/raw", "data/metrics/download.json"], ["download"]),
        "bpe": entry(["data/clean"], ["data/bpe", "data/metrics/bpe.json"], ["bpe"]),
        "train": entry(["data/shards", "data/bpe"], ["data/train", "data/metrics/train.json"],
                       ["seed", "model", "train"]),
        "audit": entry(["data/metrics/evaluate.details.json"], ["data/reports/audit.md"], ["train"])}}
    lock["stages"]["audit"]["params"]["params.yaml"]["train"]["max_steps"] = 999  # the previous audit's params
    (root / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))


def build_audit_world(root: Path, profile: str = "tiny", sizes: dict[str, dict] | None = None) -> Path:
    """A complete workspace of ``profile`` (its sections updated by ``sizes``) under ``root``, produced by the real
    stages (~10 s on the tiny profile)."""
    data, p, _ = profile_params(profile, root, sizes)
    mp = pytest.MonkeyPatch()
    mp.setenv("NMT_DATA_WORKERS", "1")
    mp.setenv("NMT_DEVICE", "cpu")
    mp.chdir(root)
    try:
        _raw(root)
        d = PATHS
        spm_model, run_dir = f"{d['bpe']}/spm.model", checkpoint_folder(p)  # <paths.train>/<digest>, as the stages
        for name, body in (
                ("clean", lambda: clean_stage(p.clean, raw_dir=d["raw"], clean_dir=d["clean"])),
                ("bpe", lambda: bpe_stage(BpeConfig(vocab_size=120, input_sentence_size=100000), clean_dir=d["clean"],
                                          bpe_dir=d["bpe"])),
                ("encode", lambda: encode_stage(p.encode, clean_dir=d["clean"], bpe_dir=d["bpe"],
                                                shards_dir=d["shards"])),
                ("train", lambda: train_stage(p.train, model_cfg=p.model, seed=p.seed, shards_dir=d["shards"],
                                              spm_model=spm_model, run_dir=run_dir,
                                              plots_path=f"{d['plots']}/train.csv")),
                ("average", lambda: average_stage(p.average, train_dir=run_dir, bpe_dir=d["bpe"],
                                                  model_dir=d["model"])),
                ("evaluate", lambda: evaluate_stage(p.evaluate, model_dir=d["model"], shards_dir=d["shards"],
                                                    raw_dir=d["raw"], eval_dir=d["eval"], train_dir=run_dir,
                                                    spm_model=spm_model))):
            run_stage(name, body, params=p, metrics_dir=d["metrics"], root=root)
    finally:
        mp.undo()
    _dvc_lock(root, data)
    return root


def synthetic_inputs(params: dict, *, metrics: dict | None = None, paper_profile: dict | None = None,
                     state: dict | None = None) -> Inputs:
    """Audit inputs without a workspace: ``params`` and the given stage details (JSON), everything else absent."""
    metrics = metrics or {}
    details = RunDetails(**{name: RECORDS[name].from_json(data, f"{name}.details.json")
                            for name, data in metrics.items()}, written=frozenset(metrics))
    return Inputs(params=params_from_dict(params), params_sha256="0" * 64, paper_profile=paper_profile, details=details,
                  raw_manifest=None, shards_manifest=None, shards_manifest_sha256=None, state=state, state_path=None,
                  model=None, lock=None, git={"commit": None, "dirty": None, "dirty_paths": []})


def demo_like_metrics() -> dict:
    """Stage details shaped like a finished ``make demo`` run (Multi30k, 700 steps on CPU, 5 checkpoints averaged)."""
    sig = {"bleu": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
           "bleu_tok_split": "t2t-get_ende_bleu:replace-unicode-punct+moses-tok-de+atat|nrefs:1|case:mixed|eff:no|"
                             "tok:none|smooth:none|version:2.6.0"}
    return {
        "download": {"dataset": "multi30k", "pairs": {"train": 29_000, "valid": 1014, "test": 1000}},
        "clean": {"train": {"pairs_out": 28_995}},
        "bpe": {"vocab_size": 8000},
        "train": {"step": 700, "tokens_seen": 1_421_178, "world_size": 1, "tokens_per_step_mean": 2030.25,
                  "tokens_per_step_std": 127.1, "tokens_per_step_min": 356, "tokens_per_step_max": 2048,
                  "forwards_per_step_mean": 1.0, "forwards_per_step_max": 1, "device": "cpu", "device_name": "cpu",
                  "wall_seconds": 534.8, "train_seconds": 505.8, "resumed_from_step": None, "valid_ppl": 15.30},
        "average": {"steps": [588, 616, 644, 672, 700], "parameters": 2_412_544},
        "evaluate": {"chosen": {"beam": 4, "alpha": 1.0, "chosen_on": "valid"},
                     "valid": {"bleu": 26.70, "bleu_tok_split": 26.68, "ppl": 14.78, "sentences": 1014,
                               "truncated_sources": 0, "signatures": sig},
                     "valid_newest": {"bleu": 26.38, "bleu_tok_split": 26.30, "ppl": 15.30, "sentences": 1014,
                                      "step": 700, "signatures": sig},
                     "test": {"bleu": 27.94, "bleu_tok_split": 27.96, "sentences": 1000, "truncated_sources": 0,
                              "signatures": sig}},
    }


_REPO_PATH = re.compile(r"(?<![\w./-])((?:pipeline|model|flows|tests|profiles)/[\w./-]*\w)")


def missing_repository_files(text: str) -> list[str]:
    """Paths into this repository's code (``pipeline/...``, ``profiles/...``) that a report names but that do not
    exist in the repository."""
    return sorted({m for m in _REPO_PATH.findall(text) if not (REPO / m).exists()})

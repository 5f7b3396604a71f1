"""A training workspace to test with: a real tiny SentencePiece model and shards written with pyarrow in
the encode stage's shard schema (pipeline/data/shard_writer.py) (a copy task on random ids), tiny-profile params,
and the train stage run in-process or under torchrun.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from pipeline.core.config import checkpoint_folder, load_params, params_from_dict
from pipeline.project.profiles import merged_profile
from pipeline.tracking.harness import run_stage
from pipeline.train import stage
from tests.helpers.paths import REPO

WORDS = "the a house cat dog green small big runs sleeps eats red blue old new tree car sees".split()


def _spm(folder: Path) -> Path:
    import sentencepiece as spm

    rng = np.random.default_rng(0)
    text = folder / "corpus.txt"
    text.write_text("\n".join(" ".join(rng.choice(WORDS, 8)) for _ in range(300)) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "spm"), vocab_size=60,
                                   model_type="bpe", pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                                   minloglevel=2, num_threads=1)
    return folder / "spm.model"


def _write_split(root: Path, split: str, rows: list[tuple[int, np.ndarray, np.ndarray]], per_shard: int) -> dict:
    tok = pa.list_(pa.uint16())
    schema = pa.schema([("id", pa.int64()), ("src", tok), ("tgt", tok), ("src_len", pa.int32()),
                        ("tgt_len", pa.int32())])
    (root / split).mkdir(parents=True)
    shards = []
    for k, start in enumerate(range(0, len(rows), per_shard)):
        part = rows[start:start + per_shard]
        table = pa.table([pa.array([r[0] for r in part], pa.int64()), pa.array([r[1].tolist() for r in part], tok),
                          pa.array([r[2].tolist() for r in part], tok),
                          pa.array([len(r[1]) for r in part], pa.int32()),
                          pa.array([len(r[2]) for r in part], pa.int32())], schema=schema)
        rel = f"{split}/part-{k:05d}.parquet"
        pq.write_table(table, root / rel, compression="zstd")
        shards.append({"path": rel, "rows": len(part), "line_start": part[0][0], "line_end": part[-1][0] + 1,
                       "src_tokens": sum(len(r[1]) for r in part), "tgt_tokens": sum(len(r[2]) for r in part),
                       "sha256": hashlib.sha256((root / rel).read_bytes()).hexdigest()})
    return {"rows": len(rows), "shards": shards}


def make_workspace(tmp: Path, n_train: int = 160, n_valid: int = 24) -> dict[str, Path]:
    """spm.model + shards (train ids with gaps) under ``tmp``; returns the paths."""
    bpe = tmp / "bpe"
    bpe.mkdir(parents=True)
    spm_model = _spm(bpe)
    rng = np.random.default_rng(1)

    def rows(n: int, gap: bool) -> list:
        out = []
        for i in range(n):
            if gap and i % 7 == 3:
                continue  # like pairs dropped by encode.max_len
            src = rng.integers(4, 60, rng.integers(1, 14)).astype(np.uint16)
            out.append((i, src, src[::-1].copy()))
        return out

    shards = tmp / "shards"
    splits = {"train": _write_split(shards, "train", rows(n_train, True), 50),
              "valid": _write_split(shards, "valid", rows(n_valid, False), 50),
              "test": _write_split(shards, "test", rows(8, False), 50)}
    manifest = {"format": 1, "spm_sha256": hashlib.sha256(spm_model.read_bytes()).hexdigest(), "vocab_size": 60,
                "splits": splits}
    (shards / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    return {"shards": shards, "spm": spm_model, "root": tmp}


def _under(tmp: Path, folder: Path, name: str) -> Path:
    """``folder`` if it lies inside ``tmp``, else a copy of it at ``tmp/data/<name>``."""
    if Path(os.path.abspath(folder)).is_relative_to(os.path.abspath(tmp)):
        return folder
    shutil.copytree(folder, tmp / "data" / name, dirs_exist_ok=True)
    return tmp / "data" / name


def tiny_params(tmp: Path, ws: dict[str, Path], **train) -> dict:
    """The tiny profile's params with paths under ``tmp`` and ``train`` overrides.

    The workspace's shards and BPE model are copied under ``tmp`` unless they lie there (they are small):
    every ``paths.*`` of a params file lies inside its folder, none inside another (pipeline/core/paths.py).
    """
    data = merged_profile("tiny", REPO)
    shards, bpe = (_under(tmp, ws["shards"], "shards"), _under(tmp, ws["spm"].parent, "bpe"))
    data["paths"].update(shards=str(shards), bpe=str(bpe), train=str(tmp / "runs"), model=str(tmp / "model"),
                         eval=str(tmp / "eval"), metrics=str(tmp / "metrics"), plots=str(tmp / "plots"))
    data["model"].update(d_model=16, n_heads=2, d_ff=32, n_layers=1, max_positions=128)
    data["train"].update(dict(tokens_per_step=192, warmup_steps=2, max_steps=6, save_every_steps=2,
                              keep_last=10, valid_every_steps=3, log_every_steps=1, lr_scale=2.0) | train)
    return data


def checkpoints(root: Path) -> Path:
    """The training folder of the last run in ``root`` (by its params.yaml): ``<paths.train>/<digest>``
    (:func:`pipeline.core.config.checkpoint_folder`)."""
    return checkpoint_folder(load_params(root / "params.yaml"))


def run_inprocess(data: dict, tmp: Path) -> dict:
    """Train in this process as ``python -m pipeline.train`` would (the stage wrapper writes the metrics), its
    params also written to ``tmp/params.yaml`` (for :func:`checkpoints`); returns the record as JSON."""
    p = params_from_dict(data)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "params.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    return run_stage("train", lambda: stage(p.train, model_cfg=p.model, seed=p.seed, shards_dir=p.paths.shards,
                                            spm_model=Path(p.paths.bpe) / "spm.model", run_dir=checkpoint_folder(p),
                                            plots_path=Path(p.paths.plots) / "train.csv"),
                     params=p, metrics_dir=p.paths.metrics).to_json()


def run_torchrun(data: dict, tmp: Path, nproc: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m pipeline.launch`` (torchrun, ``nproc`` processes, CPU unless ``env`` says otherwise) on ``data``."""
    params = tmp / "params.yaml"
    tmp.mkdir(parents=True, exist_ok=True)
    params.write_text(yaml.safe_dump(data), encoding="utf-8")
    full_env = {**os.environ, "NMT_NPROC": str(nproc), "NMT_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
                "NMT_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipeline.launch", "--params", str(params)], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=300)

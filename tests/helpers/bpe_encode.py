"""Synthetic clean text and the real ``bpe`` and ``encode`` stages run on it."""

from __future__ import annotations

import random
from pathlib import Path

from pipeline import bpe, encode
from pipeline.core.config import BpeConfig, EncodeConfig
from pipeline.tracking.harness import run_stage

EN = "the a cat dog house garden man woman sits runs sees big small red green near under".split()
DE = "der die das katze hund haus garten mann frau sitzt läuft sieht groß klein rot grün nahe unter".split()


def synthetic_clean(root: Path, n_train: int = 300, seed: int = 0) -> Path:
    """Write ``<root>/clean/{train,valid,test}.{en,de}`` of synthetic sentences; return the dir."""
    rng = random.Random(seed)
    clean = root / "clean"
    clean.mkdir(parents=True)

    def sentence(words: list[str], k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    sizes = {"train": n_train, "valid": 25, "test": 30}
    for split, n in sizes.items():
        lens = [rng.randint(1, 12) for _ in range(n)]
        en = [sentence(EN, k) for k in lens]
        de = [sentence(DE, k + rng.randint(0, 2)) for k in lens]
        if split != "train":
            en[3] = de[5] = ""  # valid/test keep empty lines
        (clean / f"{split}.en").write_text("".join(s + "\n" for s in en), encoding="utf-8")
        (clean / f"{split}.de").write_text("".join(s + "\n" for s in de), encoding="utf-8")
    return clean


def run_bpe(tmp_path: Path, clean: Path, name: str = "bpe", **kw: int) -> Path:
    out = tmp_path / name
    cfg = BpeConfig(vocab_size=kw.pop("vocab_size", 80), **kw)
    run_stage("bpe", lambda: bpe.stage(cfg, clean_dir=clean, bpe_dir=out), metrics_dir=tmp_path / "metrics" / name)
    return out


def run_encode(tmp_path: Path, clean: Path, bpe_dir: Path, name: str = "shards", **kw: int) -> Path:
    out = tmp_path / name
    cfg = EncodeConfig(max_len=kw.get("max_len", 256), shard_rows=kw.get("shard_rows", 100))
    run_stage("encode", lambda: encode.stage(cfg, clean_dir=clean, bpe_dir=bpe_dir, shards_dir=out),
              metrics_dir=tmp_path / "metrics")
    return out

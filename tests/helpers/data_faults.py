"""Synthetic raw corpora and tiny-profile params for the stage CLIs run as real processes.

Pairs carry a counter, so ``clean``'s dedup drops none of them; :func:`multi30k_mirror` lays them
out like the Multi30k repository, with the line counts its spec checks.
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import yaml

from pipeline.project.profiles import deep_merge, write_profile

EN = "the a cat dog house garden man woman sits runs sees big small red green near under".split()
DE = "der die das katze hund haus garten mann frau sitzt läuft sieht groß klein rot grün nahe unter".split()


def corpus(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` distinct synthetic EN/DE pairs (a counter keeps them apart: dedup drops nothing)."""
    rng = random.Random(seed)
    lens = [rng.randint(3, 14) for _ in range(n)]
    return ([" ".join(rng.choices(EN, k=k)) + f" {i}" for i, k in enumerate(lens)],
            [" ".join(rng.choices(DE, k=k)) + f" {i}" for i, k in enumerate(lens)])


def write_raw(raw: Path, n_train: int, seed: int = 0) -> None:
    """``<raw>/{train,valid,test}.{en,de}`` as the download stage would leave them."""
    raw.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", 50), ("test", 60)):
        for lang, lines in zip(("en", "de"), corpus(n, seed + len(split))):
            (raw / f"{split}.{lang}").write_text("".join(s + "\n" for s in lines), encoding="utf-8")


def write_params(root: Path, repo_root: Path, **overrides: dict) -> Path:
    """The tiny profile as ``<root>/params.yaml`` (paths relative to ``root``), with section overrides."""
    target = write_profile("tiny", repo_root, root / "params.yaml")
    if overrides:
        data = deep_merge(yaml.safe_load(target.read_text(encoding="utf-8")), overrides)
        target.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return target


def multi30k_mirror(root: Path) -> Path:
    """A local mirror laid out like the Multi30k repository, with the line counts its spec checks."""
    folder = root / "multi30k/data/task1/raw"
    folder.mkdir(parents=True)
    for stem, n in (("train", 29_000), ("val", 1_014), ("test_2016_flickr", 1_000)):
        for lang, lines in zip(("en", "de"), corpus(n, seed=len(stem))):
            text = "".join(s + "\n" for s in lines).encode("utf-8")
            (folder / f"{stem}.{lang}.gz").write_bytes(gzip.compress(text, mtime=0))
    return root

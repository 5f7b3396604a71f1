"""A synthetic Multi30k mirror for end-to-end runs: ``<root>/multi30k/data/task1/raw/<stem>.{en,de}.gz``.

The download stage checks the line counts of the real dataset, so every split has exactly the
count :data:`pipeline.data.sources.MULTI30K_SPEC` expects. Pairs are short sentences drawn from a small
EN/DE word list with a seeded RNG: word-for-word translations, varied enough that ``clean``'s
dedup keeps most training pairs, and (when asked) very short valid/test sentences so a toy model
decodes them in seconds. Same seed -> byte-identical files (gzip mtime 0).
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path

from pipeline.data.sources import MULTI30K_SPEC, Corpus

# (English, German) word pairs, by role.
DETERMINERS = [("a", "ein"), ("the", "der"), ("one", "ein"), ("this", "dieser")]
ADJECTIVES = [("small", "kleiner"), ("big", "großer"), ("young", "junger"), ("old", "alter"), ("happy", "froher"),
              ("tall", "großer"), ("red", "roter"), ("blue", "blauer"), ("green", "grüner"), ("black", "schwarzer"),
              ("white", "weißer"), ("brown", "brauner"), ("tired", "müder"), ("quick", "schneller")]
NOUNS = [("man", "Mann"), ("dog", "Hund"), ("boy", "Junge"), ("child", "Kind"), ("woman", "Frau"),
         ("girl", "Mädchen"), ("cat", "Katze"), ("horse", "Pferd"), ("worker", "Arbeiter"), ("player", "Spieler"),
         ("cyclist", "Radfahrer"), ("singer", "Sänger"), ("tourist", "Tourist"), ("farmer", "Bauer")]
VERBS = [("runs", "läuft"), ("sits", "sitzt"), ("stands", "steht"), ("plays", "spielt"), ("walks", "geht"),
         ("sleeps", "schläft"), ("waits", "wartet"), ("jumps", "springt"), ("works", "arbeitet"),
         ("sings", "singt")]
PLACES = [("street", "Straße"), ("park", "Park"), ("beach", "Strand"), ("field", "Feld"), ("river", "Fluss"),
          ("house", "Haus"), ("city", "Stadt"), ("garden", "Garten"), ("snow", "Schnee"), ("grass", "Gras")]
PREPOSITIONS = [("on the", "auf der"), ("in the", "in dem"), ("near the", "nahe dem"), ("by the", "an dem"),
                ("behind the", "hinter dem")]


def _pair(rng: random.Random, *, short: bool) -> tuple[str, str]:
    """One EN/DE sentence pair; ``short``: determiner noun verb (3 words)."""
    det, noun, verb = rng.choice(DETERMINERS), rng.choice(NOUNS), rng.choice(VERBS)
    if short:
        return f"{det[0].capitalize()} {noun[0]} {verb[0]}.", f"{det[1].capitalize()} {noun[1]} {verb[1]}."
    adj, prep, place = rng.choice(ADJECTIVES), rng.choice(PREPOSITIONS), rng.choice(PLACES)
    en = f"{det[0].capitalize()} {adj[0]} {noun[0]} {verb[0]} {prep[0]} {place[0]}."
    de = f"{det[1].capitalize()} {adj[1]} {noun[1]} {verb[1]} {prep[1]} {place[1]}."
    if rng.random() < 0.5:  # a second clause: more variety, longer pairs
        adj2, noun2, verb2 = rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(VERBS)
        en = f"{en[:-1]} and a {adj2[0]} {noun2[0]} {verb2[0]}."
        de = f"{de[:-1]} und ein {adj2[1]} {noun2[1]} {verb2[1]}."
    return en, de


def _write_gz(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(("\n".join(lines) + "\n").encode("utf-8"))


def write_multi30k_mirror(root: Path, *, seed: int = 0, short_eval: bool = True) -> Path:
    """Write a Multi30k-shaped mirror under ``root`` (use it as ``NMT_DATA_MIRROR``).

    Args:
        root: the mirror folder; files go to ``root/multi30k/data/task1/raw/``.
        seed: RNG seed (same seed, same bytes).
        short_eval: valid/test sentences of 3 words (fast decoding); else as long as training.

    Returns:
        ``root``.
    """
    rng = random.Random(seed)
    for split in ("train", "valid", "test"):
        corpus: Corpus
        for corpus in MULTI30K_SPEC.split(split):
            assert corpus.lines is not None
            pairs = [_pair(rng, short=short_eval and split != "train") for _ in range(corpus.lines)]
            for lang, side in (("en", corpus.en), ("de", corpus.de)):
                _write_gz(root / MULTI30K_SPEC.name / side.path, [p[0] if lang == "en" else p[1] for p in pairs])
    return root

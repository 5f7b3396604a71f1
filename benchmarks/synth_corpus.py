"""A synthetic EN-DE parallel corpus of WMT14 scale for ``benchmarks/scale.py``, in the download stage's layout
(``<out>/{train,valid,test}.{en,de}``): Zipf-distributed syllable words, log-normal sentence lengths, the German side
a noisy permutation of the English, 2% noisy pairs (:data:`NOISE_KINDS`). The output is a function of the
arguments; a smaller corpus is a prefix of a larger one (pairs come in seeded blocks of :data:`BLOCK`).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("bench.synth")

BLOCK = 20_000  # pairs per seeded block: the prefix property holds for any --pairs
ZIPF_S = 1.05
EN_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "th", "st", "ch",
             "sh", "tr", "pl", "gr"]
EN_NUCLEI = ["a", "e", "i", "o", "u", "ea", "ou", "ai"]
DE_ONSETS = ["", "b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "w", "z", "sch", "st", "pf", "kr",
             "br", "gl", "tz"]
DE_NUCLEI = ["a", "e", "i", "o", "u", "ä", "ö", "ü", "ie", "ei", "au", "eu"]
DE_CODAS = ["", "n", "ß"]
NOISE_KINDS = ("long", "misaligned", "script", "controls", "empty", "copy", "duplicate")
SCRIPTS = ((0x0410, 0x044F), (0x4E00, 0x4FFF), (0x0627, 0x064A))  # Cyrillic, CJK, Arabic letters
CONTROLS = ["\t", "\x01", "\x7f", "\u200b", "\u00a0", "\u2028", "\r"]
COMMA = 0.06
PUNCT = np.array([".", ".", ".", ".", ".", ".", "?", "!", ":", ""])


def word_forms(n: int, syllables: list[str], seed: int, capitalise_every: int = 0) -> np.ndarray:
    """[n] distinct forms of ``syllables`` by rank, short first; every ``capitalise_every``-th capitalised."""
    rng = np.random.default_rng(seed)
    forms: list[str] = []
    for k in itertools.count(1):
        block = ["".join(p) for p in itertools.islice(itertools.product(syllables, repeat=k), n - len(forms))]
        rng.shuffle(block)
        forms += block
        if len(forms) >= n:
            break
    if capitalise_every:
        forms[::capitalise_every] = [f.capitalize() for f in forms[::capitalise_every]]
    if len(set(forms)) != n:  # an empty onset and coda can make two syllable sequences spell the same form
        forms = list(dict.fromkeys(forms))
        forms += [f"{forms[i % len(forms)]}x{i}" for i in range(n - len(forms))]
    return np.array(forms, dtype=object)


def _syllables(onsets: list[str], nuclei: list[str], codas: list[str]) -> list[str]:
    return list(dict.fromkeys(o + v + c for o in onsets for v in nuclei for c in codas))


@dataclass
class Lexicon:
    """Both languages' word forms, the Zipf CDF over ranks and the EN→DE rank permutation."""

    en: np.ndarray
    de: np.ndarray
    cdf: np.ndarray
    to_de: np.ndarray

    @classmethod
    def build(cls, types: int, seed: int) -> Lexicon:
        en = word_forms(types, _syllables(EN_ONSETS, EN_NUCLEI, [""]), seed)
        de = word_forms(types, _syllables(DE_ONSETS, DE_NUCLEI, DE_CODAS), seed + 1, capitalise_every=5)
        cdf = np.cumsum(np.arange(1, types + 1, dtype=np.float64) ** -ZIPF_S)
        # Frequent words keep frequent translations: permute ranks only within bands of 64.
        band = np.random.default_rng(seed + 2).permuted(np.arange(types).reshape(-1, 1) if types < 64 else
                                                        np.arange(types // 64 * 64).reshape(-1, 64), axis=1)
        to_de = np.concatenate([band.ravel(), np.arange(band.size, types)])
        return cls(en=en, de=de, cdf=cdf / cdf[-1], to_de=to_de)

    def ranks(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(n)), len(self.cdf) - 1)


def _join(rng: np.random.Generator, words: np.ndarray, lengths: np.ndarray, punct: np.ndarray) -> list[str]:
    """Sentences from a flat word array [sum(lengths)]: capitalised, some commas, ``punct`` at the end."""
    words = words.copy()
    comma = rng.random(len(words)) < COMMA
    words[comma] = words[comma] + ","
    flat = words.tolist()
    out, pos = [], 0
    for n, p in zip(lengths.tolist(), punct.tolist()):
        s = " ".join(flat[pos:pos + n]).rstrip(",")
        pos += n
        out.append(s[:1].upper() + s[1:] + p)
    return out


def clean_block(lex: Lexicon, rng: np.random.Generator, n: int) -> tuple[list[str], list[str]]:
    """``n`` well-formed pairs: EN sentences and their German counterparts."""
    en_len = np.clip(np.rint(rng.lognormal(np.log(19.0), 0.6, n)), 1, 150).astype(np.int64)  # median 19 words
    de_len = np.maximum(1, np.rint(en_len * np.exp(rng.normal(0.0, 0.12, n)))).astype(np.int64)
    en_ranks = lex.ranks(rng, int(en_len.sum()))
    # The German side reuses the English ranks (permuted), shortened or padded with fresh draws.
    starts = np.concatenate([[0], np.cumsum(en_len)[:-1]])
    idx = np.concatenate([s + np.arange(m) for s, m in zip(starts.tolist(), de_len.tolist())])
    ends = np.repeat(starts + en_len, de_len)
    de_ranks = np.where(idx < ends, lex.to_de[en_ranks[np.minimum(idx, len(en_ranks) - 1)]],
                        lex.ranks(rng, len(idx)))
    punct = PUNCT[rng.integers(0, len(PUNCT), n)]
    return _join(rng, lex.en[en_ranks], en_len, punct), _join(rng, lex.de[de_ranks], de_len, punct)


def add_noise(lex: Lexicon, rng: np.random.Generator, en: list[str], de: list[str], share: float) -> np.ndarray:
    """Make a ``share`` of the pairs noisy in place; returns [len(en)] indices into :data:`NOISE_KINDS` (-1: clean)."""
    n = len(en)
    picks = np.flatnonzero(rng.random(n) < share)
    kinds = np.full(n, -1)
    kinds[picks] = rng.integers(0, len(NOISE_KINDS), len(picks))
    for i in picks.tolist():
        kind = NOISE_KINDS[kinds[i]]
        if kind == "long":
            m = int(rng.integers(300, 1500))
            en[i] = " ".join(lex.en[lex.ranks(rng, m)])
            de[i] = " ".join(lex.de[lex.to_de[lex.ranks(rng, m)]])
        elif kind == "misaligned":
            de[i] = de[int(rng.integers(n))]
        elif kind == "script":
            lo, hi = SCRIPTS[rng.integers(len(SCRIPTS))]
            de[i] = " ".join("".join(map(chr, rng.integers(lo, hi, rng.integers(2, 8))))
                             for _ in range(max(1, en[i].count(" ") + 1)))
        elif kind == "controls":
            for side in (en, de):
                words = side[i].split(" ")
                j = int(rng.integers(len(words)))
                words[j] = words[j] + CONTROLS[rng.integers(len(CONTROLS))]
                side[i] = " ".join(words)
        elif kind == "empty":
            (en if rng.random() < 0.5 else de)[i] = ""
        elif kind == "copy":
            de[i] = en[i]
        elif i:  # duplicate of an earlier pair of the block
            j = int(rng.integers(i))
            en[i], de[i] = en[j], de[j]
    return kinds


def write_corpus(out: Path, pairs: int, *, types: int = 3_000_000, seed: int = 1, noise: float = 0.02,
                 valid: int = 3000, test: int = 3003) -> dict:
    """Write ``out/{train,valid,test}.{en,de}`` (valid and test clean, as newstest is); returns counts and sizes."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    lex = Lexicon.build(types, seed)
    noise_counts = dict.fromkeys(NOISE_KINDS, 0)
    with open(out / "train.en", "w", encoding="utf-8", newline="\n") as f_en, \
            open(out / "train.de", "w", encoding="utf-8", newline="\n") as f_de:
        for b, start in enumerate(range(0, pairs, BLOCK)):
            rng = np.random.default_rng([seed, b])  # each block its own generator: the prefix property
            en, de = clean_block(lex, rng, BLOCK)
            kinds = add_noise(lex, rng, en, de, noise)
            n = min(BLOCK, pairs - start)  # the last block is cut: a smaller corpus is a prefix of a larger one
            f_en.write("".join(s + "\n" for s in en[:n]))
            f_de.write("".join(s + "\n" for s in de[:n]))
            for k, count in zip(*np.unique(kinds[:n][kinds[:n] >= 0], return_counts=True)):
                noise_counts[NOISE_KINDS[k]] += int(count)
            if b % 25 == 24:
                log.info("synth: %d/%d pairs written", start + len(en), pairs)
    for split, n, salt in (("valid", valid, 10**6), ("test", test, 10**6 + 1)):
        en, de = clean_block(lex, np.random.default_rng([seed, salt]), n)
        (out / f"{split}.en").write_text("".join(s + "\n" for s in en), encoding="utf-8")
        (out / f"{split}.de").write_text("".join(s + "\n" for s in de), encoding="utf-8")
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    log.info("synth: %d pairs, %.2f GB in %.0f s", pairs, sum(sizes.values()) / 1e9, time.monotonic() - started)
    return {"pairs": pairs, "types": types, "seed": seed, "noise": noise_counts, "bytes": sizes,
            "seconds": time.monotonic() - started}

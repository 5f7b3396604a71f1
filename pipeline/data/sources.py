"""The datasets the download stage knows: where each file comes from and how it becomes lines (SGML test sets
exactly as sacreBLEU 2.x reads them, so the text equals what sacreBLEU scores)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

from pipeline.core.errors import ConfigError

SPLITS = ("train", "valid", "test")
LANGS = ("en", "de")

STATMT = "http://www.statmt.org"
MULTI30K = "https://github.com/multi30k/dataset/raw/master/data/task1/raw"

Format = Literal["text", "gzip", "sgm"]


@dataclass(frozen=True, kw_only=True)
class SourceFile:
    """One side (EN or DE) of a corpus."""

    url: str  # upstream URL of the download unit: a tar(.gz) archive, or the file itself
    path: str  # inside the archive, or under the dataset's mirror folder
    archive: bool
    fmt: Format = "text"  # UTF-8 lines, gzip-compressed ones, or WMT SGML

    @property
    def url_name(self) -> str:
        """The last component of ``url`` (``dev.tgz``)."""
        return PurePosixPath(self.url.split("?", 1)[0]).name

    @property
    def label(self) -> str:
        """``dev.tgz:dev/newstest2013.en``, or the plain URL."""
        return f"{self.url_name}:{self.path}" if self.archive else self.url

    @property
    def member(self) -> str | None:
        """``path`` when it names a member of the archive at ``url``, else None."""
        return self.path if self.archive else None

    @property
    def key(self) -> str:
        """``<url>|<path>``: how the manifest and the stage's details name this file."""
        return f"{self.url}|{self.path}"

    def names(self) -> tuple[str, ...]:
        """File names a ``download.sha256`` key may use for this file's own bytes."""
        return (self.path, PurePosixPath(self.path).name) if self.archive else (self.url_name, self.path)


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A parallel corpus: aligned EN and DE files with an expected line count (None = unchecked)."""

    name: str
    en: SourceFile
    de: SourceFile
    lines: int | None = None

    def side(self, lang: str) -> SourceFile:
        return self.en if lang == "en" else self.de


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """A dataset: its mirror folder name and the corpora of each split, concatenated in order."""

    name: str
    train: tuple[Corpus, ...]
    valid: tuple[Corpus, ...]
    test: tuple[Corpus, ...]

    def split(self, name: str) -> tuple[Corpus, ...]:
        return getattr(self, name)

    def files(self) -> Iterator[tuple[str, Corpus, str, SourceFile]]:
        """Every (split, corpus, lang, file) in output order."""
        for split in SPLITS:
            for corpus in self.split(split):
                for lang in LANGS:
                    yield split, corpus, lang, corpus.side(lang)


def _tgz_pair(name: str, url: str, stem: str, lines: int) -> Corpus:
    """A corpus stored as ``<stem>.en`` / ``<stem>.de`` inside the archive at ``url``."""
    return Corpus(name=name, lines=lines,
                  en=SourceFile(url=url, path=f"{stem}.en", archive=True),
                  de=SourceFile(url=url, path=f"{stem}.de", archive=True))


def _multi30k(name: str, stem: str, lines: int) -> Corpus:
    """A Multi30k task-1 split stored as ``<stem>.{en,de}.gz`` in the dataset repository."""
    en, de = (SourceFile(url=f"{MULTI30K}/{stem}.{lang}.gz", path=f"data/task1/raw/{stem}.{lang}.gz", archive=False,
                         fmt="gzip") for lang in LANGS)
    return Corpus(name=name, lines=lines, en=en, de=de)


WMT14 = DatasetSpec(
    name="wmt14",
    train=(
        _tgz_pair("europarl-v7", f"{STATMT}/wmt13/training-parallel-europarl-v7.tgz",
                  "training/europarl-v7.de-en", 1_920_209),
        _tgz_pair("commoncrawl", f"{STATMT}/wmt13/training-parallel-commoncrawl.tgz",
                  "commoncrawl.de-en", 2_399_123),
        _tgz_pair("news-commentary-v9", f"{STATMT}/wmt14/training-parallel-nc-v9.tgz",
                  "training/news-commentary-v9.de-en", 201_288),
    ),
    valid=(_tgz_pair("newstest2013", f"{STATMT}/wmt14/dev.tgz", "dev/newstest2013", 3_000),),
    test=(
        Corpus(name="newstest2014-full", lines=3_003,
               en=SourceFile(url=f"{STATMT}/wmt14/test-full.tgz", path="test-full/newstest2014-deen-src.en.sgm",
                             archive=True, fmt="sgm"),
               de=SourceFile(url=f"{STATMT}/wmt14/test-full.tgz", path="test-full/newstest2014-deen-ref.de.sgm",
                             archive=True, fmt="sgm")),
    ),
)

MULTI30K_SPEC = DatasetSpec(
    name="multi30k",
    train=(_multi30k("multi30k-train", "train", 29_000),),
    valid=(_multi30k("multi30k-val", "val", 1_014),),
    test=(_multi30k("multi30k-test2016-flickr", "test_2016_flickr", 1_000),),
)

DATASETS: dict[str, DatasetSpec] = {"wmt14": WMT14, "multi30k": MULTI30K_SPEC}


def dataset_spec(name: str) -> DatasetSpec:
    """The table for dataset ``name`` (``wmt14`` or ``multi30k``)."""
    try:
        return DATASETS[name]
    except KeyError:
        raise ConfigError("params.yaml", [f"download.dataset: {name!r} is not one of {sorted(DATASETS)}"]) from None


_SEG = re.compile(r"<seg.*?>(.*)</seg>.*?")
_SPACE = re.compile(r"\s+")


def sgml_segments(lines: Iterable[str]) -> Iterator[str]:
    """The text of each line starting with ``<seg ``, cleaned exactly as sacreBLEU's fake-SGML reader does."""
    for line in lines:
        if line.startswith("<seg "):
            yield _SPACE.sub(" ", _SEG.sub(r"\1", line).strip())

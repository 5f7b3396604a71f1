"""What the data stages (download, clean, bpe, encode) report: their typed records, apart from the later stages'
(pipeline/core/details.py) so that a change there does not rerun them (dvc.yaml's code deps)."""

from __future__ import annotations

from typing import ClassVar, TypedDict

from pydantic import Field

from pipeline.core.record import Record, StageDetails


class Archive(Record):
    """One archive the download stage fetched and checked."""

    sha256: str | None = None
    bytes: int | None = None  # its size
    origin: str | None = None  # mirror, cache or network


class DownloadDetails(StageDetails):
    """``dataset`` and the sentence ``pairs`` per split (train, valid, test), where each file came from."""

    STAGE: ClassVar[str] = "download"
    dataset: str | None = None
    pairs: dict[str, int] = Field(default_factory=dict)
    origins: dict[str, str] = Field(default_factory=dict)  # source file key -> mirror, cache or network
    archives: dict[str, Archive] = Field(default_factory=dict)  # archive URL -> its size, sha256, origin


class PairCounts(Record):
    """One split through the clean stage: pairs read and kept; train's drops per rule, valid's and test's blanks."""

    pairs_in: int | None = None
    pairs_out: int | None = None
    dropped: dict[str, int] | None = None  # train only: pairs dropped per filter rule
    blank: int | None = None  # valid and test only: blank pairs kept


class CleanDetails(StageDetails):
    """The pair counts per split."""

    STAGE: ClassVar[str] = "clean"
    train: PairCounts = Field(default_factory=PairCounts)
    valid: PairCounts = Field(default_factory=PairCounts)
    test: PairCounts = Field(default_factory=PairCounts)


class BpeDetails(StageDetails):
    """The vocabulary built, the sentences it was learnt from and the sha256 of ``spm.model``."""

    STAGE: ClassVar[str] = "bpe"
    sentences: int | None = None  # the sample SentencePiece trained on
    vocab_size: int | None = None
    spm_sha256: str | None = None


class SplitCounts(Record):
    """One split's shards as the manifest sums them."""

    lines: int | None = None  # cleaned lines read
    rows: int | None = None  # rows written
    dropped_max_len: int | None = None  # training pairs longer than ``encode.max_len``, left out
    src_tokens: int | None = None
    tgt_tokens: int | None = None


class EncodeDetails(StageDetails):
    """The rows and tokens per split (the shards manifest describes each shard), the workers and the speed."""

    STAGE: ClassVar[str] = "encode"
    train: SplitCounts = Field(default_factory=SplitCounts)
    valid: SplitCounts = Field(default_factory=SplitCounts)
    test: SplitCounts = Field(default_factory=SplitCounts)
    workers: int | None = None  # encoding processes
    vocab_size: int | None = None
    pairs_per_s: float | None = None


class RawFile(TypedDict, total=False):
    """One source file of ``<paths.raw>/manifest.json`` (pipeline/data/raw.py)."""

    split: str
    corpus: str
    lang: str
    url: str
    member: str | None  # the archive member, None for a plain file
    format: str
    sha256: str
    bytes: int
    lines: int


class RawOutput(TypedDict, total=False):
    """One file the download stage wrote (``train.en`` ...)."""

    sha256: str
    bytes: int
    lines: int


class RawManifest(TypedDict, total=False):
    """``<paths.raw>/manifest.json`` as read (a key may be absent)."""

    dataset: str
    files: list[RawFile]
    outputs: dict[str, RawOutput]


class ShardEntry(TypedDict, total=False):
    """One Parquet shard of the shards manifest (its path relative to the manifest)."""

    path: str
    rows: int
    src_tokens: int
    tgt_tokens: int
    sha256: str


class ShardSplit(TypedDict, total=False):
    """One split of the shards manifest."""

    lines: int
    rows: int
    dropped_max_len: int
    src_tokens: int
    tgt_tokens: int
    shards: list[ShardEntry]


class ShardsManifest(TypedDict, total=False):
    """``<paths.shards>/manifest.json`` as read (pipeline/data/sharding.py writes it)."""

    format: int
    spm_sha256: str
    vocab_size: int
    token_type: str
    max_len: int
    shard_rows: int
    splits: dict[str, ShardSplit]

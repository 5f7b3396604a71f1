"""The shard reader: lengths, fetch and iter_rows agree with the clean text; corrupt inputs are named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from pipeline.core.errors import DataError
from pipeline.core.textio import read_lines
from pipeline.data.shard_reader import ShardSet, read_manifest
from tests.helpers.bpe_encode import run_bpe, run_encode, synthetic_clean

MAX_LEN = 12


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(clean dir, bpe dir, shards dir) with max_len drops, so train ids have gaps."""
    root = tmp_path_factory.mktemp("data")
    clean = synthetic_clean(root, n_train=250, seed=3)
    bpe_dir = run_bpe(root, clean)
    return clean, bpe_dir, run_encode(root, clean, bpe_dir, max_len=MAX_LEN, shard_rows=60)


@pytest.fixture
def shards_copy(tmp_path: Path, built: tuple[Path, Path, Path]) -> Path:
    """A private copy of the shards to damage."""
    return Path(shutil.copytree(built[2], tmp_path / "shards"))


def expected(clean: Path, bpe_dir: Path, split: str) -> dict[int, tuple[list[int], list[int]]]:
    sp = spm.SentencePieceProcessor(model_file=str(bpe_dir / "spm.model"))
    src = sp.encode(list(read_lines(clean / f"{split}.en")))
    tgt = sp.encode(list(read_lines(clean / f"{split}.de")))
    keep = (lambda a, b: len(a) <= MAX_LEN and len(b) <= MAX_LEN) if split == "train" else (lambda a, b: True)
    return {i: (a, b) for i, (a, b) in enumerate(zip(src, tgt)) if keep(a, b)}


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_reader_agrees_with_clean_text(built: tuple[Path, Path, Path], split: str) -> None:
    clean, bpe_dir, shards = built
    want = expected(clean, bpe_dir, split)
    data = ShardSet(shards, split)
    assert len(data) == len(want)
    ids, src_len, tgt_len = data.lengths()
    assert (ids.dtype, src_len.dtype, tgt_len.dtype) == (np.int64, np.int32, np.int32)
    assert ids.tolist() == sorted(want)
    assert src_len.tolist() == [len(want[i][0]) for i in ids.tolist()]
    assert tgt_len.tolist() == [len(want[i][1]) for i in ids.tolist()]
    rows = list(data.iter_rows())
    assert [r[0] for r in rows] == ids.tolist()
    assert all(r[1].tolist() == want[r[0]][0] and r[2].tolist() == want[r[0]][1] for r in rows)
    order = np.random.default_rng(0).permutation(ids)[:40].tolist()
    fetched = data.fetch(order)
    assert [(s.tolist(), t.tolist()) for s, t in fetched] == [want[i] for i in order]
    assert all(s.dtype == np.uint16 and t.dtype == np.uint16 for s, t in fetched)


def test_fetch_missing_ids(built: tuple[Path, Path, Path]) -> None:
    clean, bpe_dir, shards = built
    data = ShardSet(shards, "train")
    dropped = sorted(set(range(250)) - set(data.lengths()[0].tolist()))
    assert dropped, "the fixture must drop some pairs"
    with pytest.raises(KeyError, match="dropped by encode.max_len"):
        data.fetch([dropped[0]])
    with pytest.raises(KeyError, match="not in split 'train'"):
        data.fetch([250])
    with pytest.raises(KeyError):
        data.fetch([-1])
    assert data.fetch([]) == []


def test_check_spm(tmp_path: Path, built: tuple[Path, Path, Path]) -> None:
    clean, bpe_dir, shards = built
    ShardSet(shards, "valid").check_spm(bpe_dir / "spm.model")
    other = run_bpe(tmp_path, clean, "other", vocab_size=90)
    with pytest.raises(DataError, match=r"encoded with spm\.model sha256 [0-9a-f]{64}, but .*other/spm\.model "
                                        r"has sha256 [0-9a-f]{64}; rerun `dvc repro encode`"):
        ShardSet(shards, "valid").check_spm(other / "spm.model")


def test_corrupt_shard_is_named(shards_copy: Path) -> None:
    part = shards_copy / "train" / "part-00001.parquet"
    part.write_bytes(part.read_bytes()[: len(part.read_bytes()) // 2])
    data = ShardSet(shards_copy, "train")
    with pytest.raises(DataError, match=r"train/part-00001\.parquet: corrupt Parquet shard .*rerun `dvc repro encode`"):
        data.lengths()
    with pytest.raises(DataError) as info:
        data.verify()
    assert str(info.value) == (f"{part}: content does not match the sha256 in {shards_copy / 'manifest.json'} "
                               "(rewritten or damaged after encode); rerun `dvc repro encode`")
    ShardSet(shards_copy, "valid").verify()


def test_missing_shard_and_manifest(shards_copy: Path) -> None:
    (shards_copy / "test" / "part-00000.parquet").unlink()
    with pytest.raises(DataError, match=r"test/part-00000\.parquet: missing"):
        ShardSet(shards_copy, "test").verify()
    with pytest.raises(DataError, match=r"test/part-00000\.parquet: missing shard"):
        ShardSet(shards_copy, "test").fetch([0])
    with pytest.raises(DataError, match=r"no split 'dev'"):
        ShardSet(shards_copy, "dev")
    (shards_copy / "manifest.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(DataError, match=r"manifest\.json: not valid JSON"):
        read_manifest(shards_copy)
    (shards_copy / "manifest.json").write_text(json.dumps({"splits": {}}), encoding="utf-8")
    with pytest.raises(DataError, match=r"not a shards manifest"):
        ShardSet(shards_copy, "train")
    (shards_copy / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"manifest\.json: missing; run `dvc repro encode`"):
        ShardSet(shards_copy, "train")


def test_a_shard_without_a_recorded_sha256_is_refused_not_skipped(shards_copy: Path) -> None:
    manifest = json.loads((shards_copy / "manifest.json").read_text())
    entry = manifest["splits"]["valid"]["shards"][0]
    entry["sha257"] = entry.pop("sha256")  # one byte of the manifest changed
    (shards_copy / "manifest.json").write_text(json.dumps(manifest))
    part = shards_copy / entry["path"]
    part.write_bytes(b"\0" * part.stat().st_size)  # what a skipped check would let through
    with pytest.raises(DataError) as info:
        ShardSet(shards_copy, "valid").verify()
    assert str(info.value) == (f"{part}: no sha256 recorded in {shards_copy / 'manifest.json'}, so it cannot be "
                               "checked; rerun `dvc repro encode`")


def test_several_changed_shards_are_one_line_with_a_count(shards_copy: Path) -> None:
    parts = sorted((shards_copy / "train").glob("*.parquet"))
    for part in parts:
        part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(DataError) as info:
        ShardSet(shards_copy, "train").verify()
    message = str(info.value)
    assert message.startswith(f"{parts[0]}: content does not match the sha256") and "\n" not in message
    assert f"(and {len(parts) - 1} other shard(s) of split 'train'); rerun `dvc repro encode`" in message


def _rewrite(part: Path, column: str, values: list) -> None:
    """Rewrite one column of a shard, keeping the others (the manifest is not updated)."""
    table = pq.read_table(part)
    table = table.set_column(table.column_names.index(column), column, pa.array(values))
    pq.write_table(table, part)


def test_token_ids_beyond_the_vocabulary_are_named_with_the_shard(shards_copy: Path) -> None:
    data = ShardSet(shards_copy, "valid")
    part = shards_copy / data.manifest["splits"]["valid"]["shards"][0]["path"]
    rows = pq.read_table(part).column("src").to_pylist()
    _rewrite(part, "src", pa.array([[data.vocab_size + 5] * len(r) for r in rows], pa.list_(pa.uint16())))
    with pytest.raises(DataError) as info:
        data.fetch([0])
    assert str(info.value) == (f"{part}: column 'src' holds token id {data.vocab_size + 5}, beyond the vocabulary of "
                               f"{data.vocab_size} in {shards_copy / 'manifest.json'}; rerun `dvc repro encode`")


def test_columns_of_another_type_are_named_with_the_shard(shards_copy: Path) -> None:
    data = ShardSet(shards_copy, "valid")
    part = shards_copy / data.manifest["splits"]["valid"]["shards"][0]["path"]
    ids = pq.read_table(part).column("id").to_pylist()
    _rewrite(part, "id", [str(i) for i in ids])
    for read in (data.lengths, lambda: data.fetch([0])):
        with pytest.raises(DataError, match=rf"^{part}: column 'id' is string, not what the encode stage writes; "
                                            r"rerun `dvc repro encode`$"):
            read()


def test_a_shard_without_a_column_is_named_with_the_shard(shards_copy: Path) -> None:
    data = ShardSet(shards_copy, "valid")
    part = shards_copy / data.manifest["splits"]["valid"]["shards"][0]["path"]
    pq.write_table(pq.read_table(part).drop_columns(["tgt_len"]), part)
    for read in (data.lengths, lambda: data.fetch([0])):
        with pytest.raises(DataError, match=rf"^{part}: no column 'tgt_len', which the encode stage writes; "
                                            r"rerun `dvc repro encode`$"):
            read()

"""Stages ``bpe`` and ``encode``: determinism, special ids, round trip, max_len drops, bad inputs."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from pipeline import bpe
from pipeline.core.config import BpeConfig
from pipeline.core.errors import ConfigError, DataError
from pipeline.core.textio import read_lines
from pipeline.data import shard_writer
from pipeline.data.sample import Sample, sample_indices
from tests.helpers.bpe_encode import run_bpe, run_encode, synthetic_clean


def sha_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(root, clean dir, bpe dir) shared by the encode tests."""
    root = tmp_path_factory.mktemp("corpus")
    clean = synthetic_clean(root)
    return root, clean, run_bpe(root, clean)


def test_bpe_is_deterministic_with_fixed_special_ids(tmp_path: Path, corpus: tuple[Path, Path, Path]) -> None:
    _, clean, first = corpus
    second = run_bpe(tmp_path, clean, "again")
    assert sha_tree(first) == sha_tree(second)
    assert sorted(sha_tree(first)) == [".nmt-output", "spm.model", "spm.vocab"]  # the marker names the role
    sp = spm.SentencePieceProcessor(model_file=str(first / "spm.model"))
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert sp.get_piece_size() == 80
    metrics = json.loads((tmp_path / "metrics" / "again" / "bpe.details.json").read_text())
    assert metrics["sentences"] == 600 and metrics["spm_sha256"] == sha_tree(first)["spm.model"]


def test_bpe_sample_is_seeded(tmp_path: Path, corpus: tuple[Path, Path, Path]) -> None:
    _, clean, _ = corpus
    a = run_bpe(tmp_path, clean, "a", input_sentence_size=200, seed=7)
    b = run_bpe(tmp_path, clean, "b", input_sentence_size=200, seed=7)
    assert sha_tree(a) == sha_tree(b)
    assert json.loads((tmp_path / "metrics" / "a" / "bpe.details.json").read_text())["sentences"] == 200
    idx = sample_indices(1000, 100, seed=3)
    assert len(set(idx.tolist())) == 100 and (np.diff(idx) > 0).all()
    assert (idx == sample_indices(1000, 100, seed=3)).all()
    assert not (idx == sample_indices(1000, 100, seed=4)).all()


def test_bpe_bad_inputs(tmp_path: Path, corpus: tuple[Path, Path, Path]) -> None:
    _, clean, _ = corpus
    with pytest.raises(DataError, match=r"lower bpe\.vocab_size"):
        run_bpe(tmp_path, clean, "huge", vocab_size=5000)
    assert not (tmp_path / "huge").exists()
    with pytest.raises(DataError, match=r"train\.en: missing; run `dvc repro clean`"):
        run_bpe(tmp_path, tmp_path / "nowhere", "none")


def test_encode_round_trip_and_schema(tmp_path: Path, corpus: tuple[Path, Path, Path]) -> None:
    _, clean, bpe_dir = corpus
    shards = run_encode(tmp_path, clean, bpe_dir)
    sp = spm.SentencePieceProcessor(model_file=str(bpe_dir / "spm.model"))
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["spm_sha256"] == hashlib.sha256((bpe_dir / "spm.model").read_bytes()).hexdigest()
    for split in ("train", "valid", "test"):
        text = {lang: list(read_lines(clean / f"{split}.{lang}")) for lang in ("en", "de")}
        entries = manifest["splits"][split]["shards"]
        assert [e["path"] for e in entries] == [f"{split}/part-{k:05d}.parquet" for k in range(len(entries))]
        rows = 0
        for e in entries:
            table = pq.read_table(shards / e["path"])
            assert table.schema == shard_writer.shard_schema(80)
            assert table.schema.field("src").type == pa.list_(pa.uint16())
            assert table.num_rows == e["rows"] <= 100
            assert e["sha256"] == hashlib.sha256((shards / e["path"]).read_bytes()).hexdigest()
            d = table.to_pydict()
            assert d["id"] == list(range(e["line_start"], e["line_end"]))  # no drops at max_len=256
            for i, src, tgt, ns, nt in zip(d["id"], d["src"], d["tgt"], d["src_len"], d["tgt_len"]):
                assert (len(src), len(tgt)) == (ns, nt)
                assert sp.decode(src) == text["en"][i] and sp.decode(tgt) == text["de"][i]
                assert 3 not in src and 2 not in src  # no BOS/EOS stored
            assert e["src_tokens"] == sum(d["src_len"]) and e["tgt_tokens"] == sum(d["tgt_len"])
            rows += e["rows"]
        assert rows == manifest["splits"][split]["rows"] == len(text["en"])
    valid = pq.read_table(shards / "valid/part-00000.parquet").to_pydict()
    assert valid["src"][3] == [] and valid["tgt"][5] == []


def test_encode_twice_byte_identical_any_worker_count(tmp_path: Path, corpus: tuple[Path, Path, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _, clean, bpe_dir = corpus
    monkeypatch.setenv("NMT_DATA_WORKERS", "1")
    first = sha_tree(run_encode(tmp_path, clean, bpe_dir, "one", shard_rows=70))
    again = sha_tree(run_encode(tmp_path, clean, bpe_dir, "one", shard_rows=70))
    monkeypatch.setenv("NMT_DATA_WORKERS", "2")
    pooled = sha_tree(run_encode(tmp_path, clean, bpe_dir, "two", shard_rows=70))
    assert first == again == pooled
    assert len(first) == 1 + 1 + 5 + 1 + 1  # marker + manifest + 300/70 train + valid + test shards
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_max_len_drops_train_only(tmp_path: Path, corpus: tuple[Path, Path, Path]) -> None:
    _, clean, bpe_dir = corpus
    sp = spm.SentencePieceProcessor(model_file=str(bpe_dir / "spm.model"))
    max_len = 12
    lens = {s: [(len(a), len(b)) for a, b in zip(sp.encode(list(read_lines(clean / f"{s}.en"))),
                                                  sp.encode(list(read_lines(clean / f"{s}.de"))))]
            for s in ("train", "valid")}
    expected_kept = [i for i, (a, b) in enumerate(lens["train"]) if a <= max_len and b <= max_len]
    assert 0 < len(expected_kept) < len(lens["train"])
    shards = run_encode(tmp_path, clean, bpe_dir, max_len=max_len, shard_rows=64)
    manifest = json.loads((shards / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    assert train["dropped_max_len"] == len(lens["train"]) - len(expected_kept)
    assert train["rows"] == len(expected_kept) and train["lines"] == len(lens["train"])
    ids = [i for e in train["shards"]
           for i in pq.read_table(shards / e["path"], columns=["id"]).column("id").to_pylist()]
    assert ids == expected_kept
    assert manifest["splits"]["valid"]["rows"] == len(lens["valid"])
    assert manifest["splits"]["valid"]["dropped_max_len"] == 0
    assert any(max(ab) > max_len for ab in lens["valid"])  # long valid lines were kept
    metrics = json.loads((tmp_path / "metrics" / "encode.details.json").read_text())
    assert metrics["train"]["dropped_max_len"] == train["dropped_max_len"]


def test_encode_bad_inputs(tmp_path: Path, corpus: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _, clean, bpe_dir = corpus
    with pytest.raises(DataError, match=r"spm\.model: missing; run `dvc repro bpe`"):
        run_encode(tmp_path, clean, tmp_path / "nobpe")
    bad = tmp_path / "badclean"
    bad.mkdir()
    for p in clean.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    (bad / "test.de").write_text("one line\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"test\.en has 30 lines but .*test\.de has 1"):
        run_encode(tmp_path, bad, bpe_dir)
    (bad / "test.de").write_bytes(b"x\n" * 29 + b"\xff\n")
    with pytest.raises(DataError, match=r"test\.de:30: invalid UTF-8"):
        run_encode(tmp_path, bad, bpe_dir)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "spm.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match=r"junk/spm\.model: not a SentencePiece model"):
        run_encode(tmp_path, clean, tmp_path / "junk")
    shutil.rmtree(tmp_path / "junk")
    monkeypatch.setenv("NMT_DATA_WORKERS", "many")
    with pytest.raises(ConfigError, match="NMT_DATA_WORKERS"):
        run_encode(tmp_path, clean, bpe_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["badclean"]


def test_token_type_widens_for_large_vocab() -> None:
    assert shard_writer.token_type(65536) == pa.uint16()
    assert shard_writer.token_type(65537) == pa.uint32()


def test_bpe_bytes_do_not_depend_on_threads_or_paths(tmp_path: Path, corpus: tuple[Path, Path, Path]) -> None:
    _, clean, first = corpus
    sample = tmp_path / "elsewhere" / "sample.txt"
    sample.parent.mkdir()
    lines = list(Sample([clean / "train.en", clean / "train.de"], 10**7, seed=1))
    sample.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    assert len(lines) == 600
    for threads in (1, 3):
        bpe.train_model(sample, tmp_path / f"t{threads}", BpeConfig(vocab_size=80), threads)
        assert (tmp_path / f"t{threads}.model").read_bytes() == (first / "spm.model").read_bytes()
        assert (tmp_path / f"t{threads}.vocab").read_bytes() == (first / "spm.vocab").read_bytes()

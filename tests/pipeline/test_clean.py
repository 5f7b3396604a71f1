"""Stage ``clean``: normalisation, each filter rule, complete valid/test, and every bad input."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.clean import stage
from pipeline.core.config import CleanConfig
from pipeline.core.data_details import CleanDetails, PairCounts
from pipeline.core.errors import DataError
from pipeline.core.textio import read_lines
from pipeline.data.filters import DigestSet, pair_digest
from pipeline.data.normalize import normalize
from tests.helpers.clean import write_raw


def run_clean(tmp_path: Path, cfg: CleanConfig | None = None) -> CleanDetails:
    return stage(cfg or CleanConfig(), raw_dir=tmp_path / "raw", clean_dir=tmp_path / "clean")


def clean_pairs(tmp_path: Path, split: str) -> list[tuple[str, str]]:
    return list(zip(read_lines(tmp_path / "clean" / f"{split}.en"), read_lines(tmp_path / "clean" / f"{split}.de")))


def assert_nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "clean").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".clean")] == []


@pytest.mark.parametrize("raw, expected", [
    ("  a   b  ", "a b"),
    ("a\tb", "a b"),
    ("a\rb", "a b"),
    ("a\u0085b", "a b"),
    ("a\u2028b\u2029c", "a b c"),
    ("a\u00a0b", "a b"),
    ("x\u200by\ufeff", "xy"),            # Cf removed
    ("\x00a\x07b\x1b", "ab"),             # Cc (non-space) removed
    ("e\u0301", "\u00e9"),                # NFC
    ("e\u200b\u0301", "\u00e9"),          # NFC after removing the Cf between base and mark
    ("Straße café", "Straße café"),
    ("", ""),
    ("\t \u3000", ""),
])
def test_normalize(raw: str, expected: str) -> None:
    assert normalize(raw) == expected
    assert normalize(expected) == expected


def test_each_rule_drops_what_it_should(tmp_path: Path) -> None:
    good = [(f"the cat number {i}", f"die katze nummer {i}") for i in range(5)]
    train = good + [
        ("", "leer"), ("empty", "   "),                                    # empty x2
        ("a b c d e f g h i j k", "a b c d e f g h i j k l"),              # too_long (max_words=10)
        ("one", "eins zwei"),                                              # too_short (min_words=2)
        ("one two", "eins zwei drei vier fünf sechs"),                     # ratio (3.0 > 1.5)
        ("same text here", "same  text here"),                             # copy (after normalisation)
        good[0], (good[1][0] + " ", good[1][1]),                           # duplicate x2
    ]
    write_raw(tmp_path / "raw", {"train": train, "valid": good, "test": good})
    metrics = run_clean(tmp_path, CleanConfig(max_words=10, min_words=2, max_ratio=1.5))
    assert metrics.train == PairCounts(pairs_in=len(train), pairs_out=5, dropped={
        "empty": 2, "too_short": 1, "too_long": 1, "ratio": 1, "copy": 1, "duplicate": 2})
    assert clean_pairs(tmp_path, "train") == good


def test_rules_can_be_switched_off(tmp_path: Path) -> None:
    train = [("same", "same"), ("same", "same"), ("a b", "c d")]
    write_raw(tmp_path / "raw", {"train": train, "valid": train, "test": train})
    metrics = run_clean(tmp_path, CleanConfig(dedup=False, drop_copies=False))
    assert metrics.train.pairs_out == 3
    assert clean_pairs(tmp_path, "train") == train


def test_valid_and_test_are_complete(tmp_path: Path) -> None:
    odd = [("", ""), ("copy", "copy"), ("copy", "copy"), ("x " * 300, "y"), ("  a\tb ", "c\u200b d"), ("", "nur")]
    write_raw(tmp_path / "raw", {"train": [("a", "b")], "valid": odd, "test": odd[::-1]})
    metrics = run_clean(tmp_path)
    for split, pairs in (("valid", odd), ("test", odd[::-1])):
        assert getattr(metrics, split) == PairCounts(pairs_in=len(pairs), pairs_out=len(pairs), blank=2)
        assert clean_pairs(tmp_path, split) == [(normalize(a), normalize(b)) for a, b in pairs]


def test_odd_line_breaks_keep_alignment(tmp_path: Path) -> None:
    train = [("first\rline", "erste\rzeile"), ("second\u0085one", "zweite"), ("third\u2028x", "dritte\u2029y"),
             ("fourth", "vierte")]
    write_raw(tmp_path / "raw", {"train": train, "valid": train, "test": train})
    metrics = run_clean(tmp_path, CleanConfig(max_ratio=3.0))
    assert metrics.train.pairs_out == 4
    assert clean_pairs(tmp_path, "train") == [("first line", "erste zeile"), ("second one", "zweite"),
                                              ("third x", "dritte y"), ("fourth", "vierte")]


def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    write_raw(tmp_path / "raw", {"train": [("a", "b")] * 3, "valid": [("a", "b")], "test": [("a", "b")]})
    (tmp_path / "raw" / "valid.de").write_bytes(b"ok\nbad \xff here\n")
    (tmp_path / "raw" / "valid.en").write_bytes(b"ok\nfine\n")
    with pytest.raises(DataError, match=r"valid\.de:2: invalid UTF-8"):
        run_clean(tmp_path)
    assert_nothing_written(tmp_path)


def test_line_count_mismatch_names_both_files(tmp_path: Path) -> None:
    write_raw(tmp_path / "raw", {"train": [("a", "b")] * 3, "valid": [("a", "b")], "test": [("a", "b")]})
    (tmp_path / "raw" / "test.de").write_text("x\ny\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"test\.en has 1 lines but .*test\.de has 2"):
        run_clean(tmp_path)
    assert_nothing_written(tmp_path)


def test_missing_raw_file(tmp_path: Path) -> None:
    write_raw(tmp_path / "raw", {"train": [("a", "b")], "valid": [("a", "b")]})
    with pytest.raises(DataError, match=r"test\.en: missing; run `dvc repro download`"):
        run_clean(tmp_path)
    assert_nothing_written(tmp_path)


def test_corpus_emptied_by_filters(tmp_path: Path) -> None:
    write_raw(tmp_path / "raw", {"train": [("same", "same"), ("", "x")], "valid": [("a", "b")], "test": [("a", "b")]})
    with pytest.raises(DataError, match=r"every one of the 2 training pairs was dropped \(empty=1, copy=1\).*"
                                        r"clean\.min_words=1.*clean\.drop_copies=True"):
        run_clean(tmp_path)
    assert_nothing_written(tmp_path)


def test_failure_keeps_previous_output(tmp_path: Path) -> None:
    write_raw(tmp_path / "raw", {"train": [("a", "b")], "valid": [("a", "b")], "test": [("a", "b")]})
    run_clean(tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()}
    (tmp_path / "raw" / "train.en").write_bytes(b"\xfe\n")
    with pytest.raises(DataError, match=r"train\.en:1"):
        run_clean(tmp_path)
    assert {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()} == before


def test_rerun_is_byte_identical(tmp_path: Path) -> None:
    rng = random.Random(0)
    words = "the a cat dog sat on mat ran far house big small".split()
    train = [(" ".join(rng.choices(words, k=rng.randint(1, 8))), " ".join(rng.choices(words, k=rng.randint(1, 8))))
             for _ in range(500)]
    write_raw(tmp_path / "raw", {"train": train, "valid": train[:20], "test": train[:30]})
    run_clean(tmp_path, CleanConfig(max_ratio=3.0))
    first = {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()}
    run_clean(tmp_path, CleanConfig(max_ratio=3.0))
    assert {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()} == first
    kept = clean_pairs(tmp_path, "train")
    assert len(set(kept)) == len(kept)


def test_digest_set_matches_python_set() -> None:
    rng = random.Random(1)
    digests = [pair_digest(str(rng.randrange(2000)), "x") for _ in range(6000)]
    table = DigestSet(capacity=8)  # forces several rehashes
    fresh = np.concatenate([table.add_batch(digests[i:i + 1000]) for i in range(0, len(digests), 1000)])
    seen: set[bytes] = set()
    expected = []
    for d in digests:
        expected.append(d not in seen)
        seen.add(d)
    assert fresh.tolist() == expected
    assert len(table) == len(seen)


def test_cli_one_line_error(tmp_path: Path, repo_root: Path) -> None:
    from pipeline.project.profiles import merged_profile

    params = merged_profile("tiny", repo_root)
    params["paths"] = {k: str(tmp_path / k) for k in params["paths"]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    write_raw(tmp_path / "raw", {"train": [("a b", "c d")], "valid": [("a", "b")], "test": [("a", "b")]})
    ok = subprocess.run([sys.executable, "-m", "pipeline.clean", "--params", str(tmp_path / "params.yaml")],
                        cwd=repo_root, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    details = json.loads((tmp_path / "metrics" / "clean.details.json").read_text())
    assert details["train"]["pairs_out"] == 1 and details["mlflow_run_id"] is None
    assert not (tmp_path / "metrics" / "clean.json").exists()  # not a stage whose numbers DVC compares
    (tmp_path / "raw" / "valid.de").write_text("", encoding="utf-8")
    bad = subprocess.run([sys.executable, "-m", "pipeline.clean", "--params", str(tmp_path / "params.yaml")],
                         cwd=repo_root, capture_output=True, text=True)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("error: stage clean: ")
    assert "valid.de has 0" in bad.stderr


@pytest.mark.parametrize("split", ["valid", "test"])
def test_an_all_blank_valid_or_test_set_is_refused(tmp_path: Path, split: str) -> None:
    good = [("a small house", "ein kleines Haus"), ("the dog", "der Hund")]
    splits = {"train": good * 3, "valid": good, "test": good}
    splits[split] = [("", ""), ("  \t", "x"), ("y", " ")]  # every pair lacks a side after normalisation
    write_raw(tmp_path / "raw", splits)
    with pytest.raises(DataError, match=rf"raw/{split}\.en and .*raw/{split}\.de: all 3 pairs are blank on one side "
                                        r"or both after normalisation: nothing to score"):
        run_clean(tmp_path)
    assert_nothing_written(tmp_path)


def test_some_blank_valid_lines_are_kept_and_counted(tmp_path: Path) -> None:
    good = [("a small house", "ein kleines Haus"), ("the dog", "der Hund")]
    write_raw(tmp_path / "raw", {"train": good * 3, "valid": [*good, ("", "")], "test": good})
    assert run_clean(tmp_path).valid == PairCounts(pairs_in=3, pairs_out=3, blank=1)

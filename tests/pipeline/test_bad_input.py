"""Bad input: rejected with the exact message naming file and line, and nothing half-written.

Only what other test files do not cover already: EN/DE line-count mismatches and invalid UTF-8 in
clean, encode and download, a corpus the filters empty, a truncated shard and shards of another BPE
model at the reader level live in test_clean, test_bpe_encode, test_download, test_data and
test_evaluate. Here: NUL bytes (valid UTF-8, but the mark of a binary or UTF-16 file), empty
splits, invalid text reaching ``bpe``, a corrupt shard seen through the ``evaluate`` stage's CLI,
and ``nmt translate`` on empty input, binary garbage and a very long line.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import bpe, encode
from pipeline.clean import main as clean_main
from pipeline.cli import main as nmt_main
from pipeline.core.config import BpeConfig, EncodeConfig
from pipeline.core.errors import DataError
from pipeline.evaluate import main as evaluate_main
from pipeline.project.profiles import merged_profile
from pipeline.tracking.harness import run_stage
from tests.helpers.bpe_encode import synthetic_clean
from tests.helpers.clean import write_raw
from tests.helpers.models import make_averaged
from tests.helpers.paths import REPO

NUL_REMEDY = ("this is not UTF-8 text (a binary, UTF-16 or corrupt file?): replace the file with the real UTF-8 "
              "text (e.g. iconv -f utf-16 -t utf-8)")
PAIRS = [("a small cat", "eine kleine katze"), ("the big dog runs", "der große hund läuft")]


def params_file(tmp_path: Path, repo_root: Path, **paths: Path) -> Path:
    """Tiny-profile params whose ``paths`` point into ``tmp_path`` (or where given)."""
    params = merged_profile("tiny", repo_root)
    params["paths"] = {k: str(paths.get(k, tmp_path / k)) for k in params["paths"]}
    target = tmp_path / "params.yaml"
    target.write_text(yaml.safe_dump(params), encoding="utf-8")
    return target


def written(tmp_path: Path, *names: str) -> list[str]:
    """Which of ``names`` (outputs, or their temporary siblings) exist under ``tmp_path``."""
    return sorted(p.name for p in tmp_path.iterdir() if any(p.name == n or p.name.startswith(f".{n}.")
                                                            for n in names))


def stage_error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert not any(line.startswith("Traceback") for line in lines)
    return lines[-1]


# --- clean -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, data, other, line, byte", [
    ("valid.de", b"ok\nbad\x00line\n", b"ok\nfine\n", 2, 3),                       # one stray NUL
    ("train.en", "a small cat\nthe dog\n".encode("utf-16-le"), b"a\nb\nc\n", 1, 1),  # UTF-16 (3 lines by \\n)
])
def test_nul_byte_is_rejected_with_file_and_line(tmp_path: Path, repo_root: Path,
                                                 capsys: pytest.CaptureFixture[str], name: str, data: bytes,
                                                 other: bytes, line: int, byte: int) -> None:
    raw = tmp_path / "raw"
    write_raw(raw, {"train": PAIRS, "valid": PAIRS, "test": PAIRS})
    (raw / name).write_bytes(data)
    split, lang = name.split(".")
    (raw / f"{split}.{'de' if lang == 'en' else 'en'}").write_bytes(other)  # aligned: the NUL is what is wrong
    assert clean_main(["--params", str(params_file(tmp_path, repo_root))]) == 1
    assert stage_error(capsys) == f"error: stage clean: {raw / name}:{line}: NUL byte at byte {byte} of the line; " \
                                  f"{NUL_REMEDY}"
    assert written(tmp_path, "clean", "metrics") == []


@pytest.mark.parametrize("split, need", [
    ("train", "nothing to train on"),
    ("valid", "the valid set is needed for validation and BLEU"),
    ("test", "the test set is needed for validation and BLEU"),
])
def test_empty_split_is_rejected_before_anything_is_written(tmp_path: Path, repo_root: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             split: str, need: str) -> None:
    raw = tmp_path / "raw"
    write_raw(raw, {"train": PAIRS, "valid": PAIRS, "test": PAIRS} | {split: []})
    assert (raw / f"{split}.en").stat().st_size == 0
    assert clean_main(["--params", str(params_file(tmp_path, repo_root))]) == 1
    assert stage_error(capsys) == (f"error: stage clean: {raw}/{split}.en and {raw}/{split}.de are empty: {need}; "
                                   "check or rerun the download stage (`dvc repro download`)")
    assert written(tmp_path, "clean", "metrics") == []


# --- bpe and encode --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(clean dir, bpe dir) of a small synthetic corpus."""
    root = tmp_path_factory.mktemp("bad")
    clean = synthetic_clean(root, n_train=200)
    out = root / "bpe"
    bpe.stage(BpeConfig(vocab_size=80), clean_dir=clean, bpe_dir=out)
    return clean, out


def damaged_copy(clean: Path, tmp_path: Path, name: str, data: bytes) -> Path:
    copy = Path(shutil.copytree(clean, tmp_path / "clean"))
    (copy / name).write_bytes(data)
    return copy


@pytest.mark.parametrize("data, message", [
    (b"eine katze\nder hund\nein \xe4pfel\n",
     "train.de:3: invalid UTF-8 at byte 4 of the line; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"),
    (b"eine katze\nder\x00hund\n", f"train.de:2: NUL byte at byte 3 of the line; {NUL_REMEDY}"),
    (b"", "hold no text; rerun `dvc repro clean`"),
])
def test_bpe_rejects_bad_training_text(tmp_path: Path, text: tuple[Path, Path], data: bytes, message: str) -> None:
    clean = damaged_copy(text[0], tmp_path, "train.de", data)
    if not data:
        (clean / "train.en").write_bytes(b"")
    with pytest.raises(DataError, match=re.escape(message)):
        run_stage("bpe", lambda: bpe.stage(BpeConfig(vocab_size=80), clean_dir=clean, bpe_dir=tmp_path / "bpe"),
                  metrics_dir=tmp_path)
    assert written(tmp_path, "bpe", "bpe.json", "bpe.details.json") == []


@pytest.mark.parametrize("bad, message", [
    (b"\x00", f"NUL byte at byte 0 of the line; {NUL_REMEDY}"),
    (b"\xe4", "invalid UTF-8 at byte 0 of the line; re-encode the file as UTF-8"),
])
def test_encode_rejects_bad_bytes_and_empty_splits(tmp_path: Path, text: tuple[Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch, bad: bytes, message: str) -> None:
    monkeypatch.setenv("NMT_DATA_WORKERS", "1")
    clean, bpe_dir = text
    lines = (clean / "test.de").read_bytes().split(b"\n")
    lines[6] = bad + lines[6]
    damaged = damaged_copy(clean, tmp_path, "test.de", b"\n".join(lines))
    cfg = EncodeConfig(max_len=64, shard_rows=4)  # line 7 is the 3rd line of the 2nd shard of test
    with pytest.raises(DataError, match=re.escape(f"{damaged}/test.de:7: {message}")):
        run_stage("encode", lambda: encode.stage(cfg, clean_dir=damaged, bpe_dir=bpe_dir, shards_dir=tmp_path / "shards"),
                  metrics_dir=tmp_path)
    assert written(tmp_path, "shards", "encode.json", "encode.details.json") == []
    for lang in ("en", "de"):
        (damaged / f"valid.{lang}").write_bytes(b"")
    (damaged / "test.de").write_bytes((clean / "test.de").read_bytes())
    with pytest.raises(DataError, match=re.escape(f"{damaged}/valid.en and {damaged}/valid.de are empty: every split "
                                                  "needs text; rerun `dvc repro clean`")):
        run_stage("encode", lambda: encode.stage(cfg, clean_dir=damaged, bpe_dir=bpe_dir, shards_dir=tmp_path / "shards"),
                  metrics_dir=tmp_path)
    assert written(tmp_path, "shards", "encode.json", "encode.details.json") == []


# --- shards seen by a later stage ------------------------------------------------------------------

def test_corrupt_shard_through_the_evaluate_cli(eval_world: Path, tmp_path: Path, repo_root: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    shards = Path(shutil.copytree(eval_world / "shards", tmp_path / "shards"))
    part = shards / "valid" / "part-00001.parquet"
    part.write_bytes(part.read_bytes()[:40])
    model, raw = (Path(shutil.copytree(eval_world / name, tmp_path / name)) for name in ("model", "raw"))
    params = params_file(tmp_path, repo_root, model=model, raw=raw, shards=shards)  # paths inside its folder
    assert evaluate_main(["--params", str(params)]) == 1
    assert re.fullmatch(rf"error: stage evaluate: {re.escape(str(part))}: corrupt Parquet shard \(.+\); .*"
                        r"`dvc repro encode`.*", stage_error(capsys))
    assert written(tmp_path, "eval", "metrics") == []


# --- nmt translate ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_averaged(tmp_path_factory.mktemp("translate"), seed=5)


def _translate(model: Path, stdin: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "translate", "--model", str(model), "--beam", "2",
                           "--max-len-b", "5"], check=False, input=stdin, capture_output=True, timeout=120,
                          cwd=REPO)


def test_translate_empty_input_gives_empty_output(model_file: Path, tmp_path: Path) -> None:
    proc = _translate(model_file, b"")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == b"" and b"error" not in proc.stderr and b"WARNING" not in proc.stderr
    empty, out = tmp_path / "empty.en", tmp_path / "out.de"
    empty.write_bytes(b"")
    assert nmt_main(["translate", "--model", str(model_file), "--input", str(empty), "--output", str(out)]) == 0
    assert out.read_bytes() == b""


def test_translate_survives_binary_garbage_and_a_huge_line(model_file: Path) -> None:
    rng = random.Random(0)
    garbage = [b"\x00" + rng.randbytes(300).replace(b"\n", b"\x00") for _ in range(4)]
    huge = " ".join(rng.choice(["house", "garden", "the", "small", "dog"]) for _ in range(40_000)).encode()
    lines = [b"A small dog.", garbage[0], garbage[1], b"", huge, garbage[2], garbage[3], b"The end."]
    proc = _translate(model_file, b"\n".join(lines) + b"\n")
    stderr = proc.stderr.decode("utf-8", errors="replace")
    assert proc.returncode == 0, stderr
    out = proc.stdout.decode("utf-8").split("\n")
    assert len(out) == len(lines) + 1 and out[-1] == ""  # one line out per line in, each ended by \n
    assert out[3] == ""
    invalid = [i + 1 for i, line in enumerate(lines) if _invalid(line)]
    assert invalid, "the garbage must hold invalid UTF-8"
    # Standard input is translated in chunks as it arrives: each chunk warns about its own lines, numbered in
    # the whole input, so together the warnings name every altered line once.
    assert _warned(stderr, "had invalid UTF-8, replaced by U+FFFD") == invalid
    assert _warned(stderr, "had NUL bytes (binary input?), replaced by U+FFFD") == [2, 3, 6, 7]
    assert 5 in _warned(stderr, "longer than the model's max_positions (64 tokens with EOS) were truncated")


def _warned(stderr: str, what: str) -> list[int]:
    """The line numbers that warnings ``<n> [input ]line(s) <what>: line(s) <numbers>`` name, in order."""
    numbers: list[int] = []
    for count, listed in re.findall(rf"(\d+) (?:input )?line\(s\) {re.escape(what)}: line\(s\) ([0-9, ]+)", stderr):
        named = [int(n) for n in listed.split(",")]
        assert len(named) == int(count), (count, listed)
        numbers += named
    return numbers


def _invalid(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


TOO_LONG = ("line {n} is longer than 1048576 bytes (MAX_LINE_BYTES; the model reads at most max_positions tokens of a "
            "line anyway); put one sentence on each line")


@pytest.mark.parametrize("source", ["/dev/zero", "twenty-mb.en"])
def test_translate_refuses_an_endless_or_huge_input_line_at_the_bound(model_file: Path, tmp_path: Path,
                                                                      source: str) -> None:
    """``--input /dev/zero`` read 5.4 GB before a MemoryError, one 20 MB line took 1.17 GB: both are one line
    naming the file and the line, before the model loads, nothing written."""
    if source != "/dev/zero":
        (tmp_path / source).write_bytes(b"A man.\n" + b"a" * (20 << 20) + b"\n")
    out = tmp_path / "out.de"
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "translate", "--model", str(model_file), "--input",
                           source, "--output", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    line = 1 if source == "/dev/zero" else 2
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", f"error: {source}: {TOO_LONG.format(n=line)}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if source == "/dev/zero" else [source])


def test_translate_refuses_an_endless_stdin_line_having_read_only_the_bound(model_file: Path) -> None:
    """An endless line on standard input grew without bound (re-joined on every 64 KiB read): now the lines
    before it are translated and the command stops once the line passes the bound, reading little more."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "translate", "--model", str(model_file),
                             "--beam", "1", "--max-len-b", "3"], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sent = 0
    try:
        proc.stdin.write(b"A small dog.\n")
        sent = 13
        block = b"a" * (1 << 16)
        while sent < 64 << 20:  # 64 MiB offered, never a newline
            proc.stdin.write(block)
            proc.stdin.flush()
            sent += len(block)
    except BrokenPipeError:
        pass
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and len(stdout.decode().splitlines()) == 1, stderr.decode()
    assert stderr.decode().splitlines()[-1] == f"error: standard input: {TOO_LONG.format(n=2)}"
    assert sent < 4 << 20  # the reader stopped at the bound (plus what the pipe holds)


def test_translate_refuses_an_input_file_over_the_total_bound(model_file: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.inference import lines

    monkeypatch.setattr(lines, "MAX_INPUT_BYTES", 1000)
    (tmp_path / "in.en").write_bytes(b"A small dog.\n" * 100)
    assert nmt_main(["translate", "--model", str(model_file), "--input", str(tmp_path / "in.en"),
                     "--output", str(tmp_path / "out.de")]) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'in.en'}: more than 1000 bytes (MAX_INPUT_BYTES: --input "
                                       "is read whole); translate it in parts, or pipe it to standard input, "
                                       "translated as lines arrive\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en"]

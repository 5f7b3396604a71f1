"""``nmt translate`` on a random tiny averaged model: lines kept, bad bytes and long lines survive, PNG drawn."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from pipeline.core.errors import CheckpointError, PipelineError
from pipeline.core.textio import read_lines
from pipeline.inference.common import check_cuda
from pipeline.inference.decoding import load_translator
from pipeline.inference.translate import decode_lines, split_lines, translate_lines
from tests.helpers.models import make_averaged, make_small_vocab_averaged
from tests.helpers.paths import REPO

LONG = " ".join(["Gutach Sicherheit für Fußgänger"] * 60)  # far beyond max_positions (64)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_averaged(tmp_path_factory.mktemp("translate"), seed=3)


def _nmt(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "translate", *args], input=stdin,
                          capture_output=True, timeout=120, cwd=REPO)


@pytest.mark.slow
def test_cli_stdin_to_stdout_keeps_every_line(model_file: Path) -> None:
    stdin = "Gutach: Increased safety\n\nBad ".encode() + b"\xff\xfe bytes\n" + LONG.encode() + b"\nlast, no newline"
    proc = _nmt("--model", str(model_file), "--beam", "2", "--alpha", "0.6", "--max-tokens", "64", stdin=stdin)
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    out = proc.stdout.decode("utf-8").split("\n")
    assert out[-1] == "" and len(out) - 1 == 5  # one output line per input line, each ended by \n
    assert out[1] == ""  # an empty line stays empty
    assert all(line for i, line in enumerate(out[:-1]) if i != 1)
    assert "1 input line(s) had invalid UTF-8, replaced by U+FFFD: line(s) 3" in stderr
    assert "1 line(s) longer than the model's max_positions (64 tokens with EOS) were truncated: line(s) 4" in stderr


def test_cli_files_and_attention_png(model_file: Path, tmp_path: Path) -> None:
    src, out, png = tmp_path / "in.en", tmp_path / "out.de", tmp_path / "attn.png"
    src.write_text("\nThe price is new.\nYesterday, the mayor answered.\n", encoding="utf-8")
    rc = main(["translate", "--model", str(model_file), "--input", str(src), "--output", str(out), "--beam", "3",
               "--attention-png", str(png), "--attention-layer", "1"])
    assert rc == 0
    lines = list(read_lines(out))
    assert len(lines) == 3 and lines[0] == "" and lines[1] and lines[2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


@pytest.mark.parametrize("layer", ["5", "0", "-1"])
def test_attention_layer_out_of_range_is_refused_before_decoding(model_file: Path, tmp_path: Path, layer: str,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Layers are numbered 1..n_layers; the check runs after the model is loaded and before any search."""
    caplog.set_level(logging.INFO, logger="pipeline.inference.decoding")
    src = tmp_path / "in.en"
    src.write_text("Hello.\n", encoding="utf-8")
    rc = main(["translate", "--model", str(model_file), "--input", str(src), "--output", str(tmp_path / "o"),
               "--attention-png", str(tmp_path / "a.png"), "--attention-layer", layer])
    assert rc == 1
    assert capsys.readouterr().err == (f"error: --attention-layer {layer}: the model has 1 decoder layer(s); "
                                       "use 1..1 (default 1, the last)\n")
    assert not (tmp_path / "a.png").exists() and not (tmp_path / "o").exists()
    assert not [r for r in caplog.records if r.name == "pipeline.inference.decoding"]  # nothing was decoded


def _refusal(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a refused ``nmt translate`` (exit code 1, nothing on stdout)."""
    assert main(["translate", *args]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err.removesuffix("\n")


def test_attention_options_are_refused_before_the_model_is_loaded(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A model path that does not exist: each refusal below comes before the model would be loaded."""
    src = tmp_path / "in.en"
    src.write_text("First line.\n\nThird line.\n", encoding="utf-8")
    blank = tmp_path / "blank.en"
    blank.write_text("\n \u200b\n", encoding="utf-8")
    base = ["--model", str(tmp_path / "missing.pt"), "--input", str(src)]
    png = str(tmp_path / "a.png")
    cases = {
        (f"--attention-png {tmp_path}/no/such/a.png: folder {tmp_path}/no/such does not exist; create it or choose "
         "another path"): ["--attention-png", str(tmp_path / "no" / "such" / "a.png")],
        f"--attention-png {tmp_path}: is a folder; name a PNG file": ["--attention-png", str(tmp_path)],
        f"--attention-line 4: {src} has only 3 line(s)": ["--attention-png", png, "--attention-line", "4"],
        f"--attention-line 2: line 2 of {src} is empty; choose a non-empty line": [
            "--attention-png", png, "--attention-line", "2"],
        "--attention-line 0: lines are numbered from 1": ["--attention-png", png, "--attention-line", "0"],
        "--attention-layer and --attention-line choose what --attention-png draws: add --attention-png FILE": [
            "--attention-layer", "1"],
    }
    for message, args in cases.items():
        assert _refusal([*base, *args], capsys) == f"error: {message}"
    blank_args = ["--model", str(tmp_path / "missing.pt"), "--input", str(blank), "--attention-png", png]
    assert _refusal(blank_args, capsys) == f"error: --attention-png: {blank} has no non-empty line to draw"
    assert not list(tmp_path.glob("*.png"))


def test_an_unwritable_png_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):
        pytest.skip("running as root: permissions do not apply")
    args = ["--model", str(tmp_path / "missing.pt"), "--attention-png", str(locked / "a.png")]
    assert _refusal(args, capsys) == (f"error: --attention-png {locked}/a.png: folder {locked} is not writable; "
                                      "choose another path")


def test_the_figure_numbers_layers_and_heads_from_one(tmp_path: Path) -> None:
    from pipeline.inference.attention import attention_figure

    translator = load_translator(make_averaged(tmp_path, seed=4, n_layers=2), "cpu")
    _, sources, hyps, _ = translate_lines(translator, ["The price is new."], beam_size=2, max_len_b=4)
    for layer, index in ((1, 0), (2, 1), (None, 1)):
        fig = attention_figure(translator, sources[0], hyps[0], layer)
        panels = [ax for ax in fig.axes if ax.get_title()]
        assert [ax.get_title() for ax in panels] == [f"layer {index + 1}, head 1", f"layer {index + 1}, head 2"]
        src = torch.tensor(sources[0])
        tgt_in = torch.tensor([translator.config.bos_id, *hyps[0]])
        want = translator.model.cross_attention(src, tgt_in, layer=index).float()
        assert torch.equal(torch.as_tensor(panels[1].images[0].get_array()), want[1])


DEVICE_REFUSALS = {
    "gpu": "--device gpu: not a device; use cpu, cuda or cuda:N (N = 0 for the first GPU)",
    "cpu:1": "--device cpu:1: not a device; use cpu, cuda or cuda:N (N = 0 for the first GPU)",
}


@pytest.mark.parametrize("device", ["gpu", "cpu:1", "cuda", "cuda:3"], ids=lambda d: f"device={d}")  # not the gpu mark
def test_a_device_this_machine_cannot_use_is_one_line_before_the_model_loads(tmp_path: Path, device: str) -> None:
    """The model file does not exist: the device is refused first, without a traceback."""
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA (test_a_cuda_index_past_the_last_gpu_is_refused covers it)")
    expected = DEVICE_REFUSALS.get(device, f"--device {device}: this torch build sees no CUDA device "
                                           "(torch.cuda.is_available() is False); use --device cpu or leave "
                                           "--device out")
    proc = _nmt("--model", str(tmp_path / "missing.pt"), "--device", device, stdin=b"Hello\n")
    assert proc.returncode == 1 and proc.stdout == b""
    assert proc.stderr.decode().splitlines() == [f"error: {expected}"]


def test_a_cuda_index_past_the_last_device_names_the_range() -> None:
    with pytest.raises(PipelineError) as info:
        check_cuda("cuda:3", 3, 1)
    assert str(info.value) == ("--device cuda:3: this machine has 1 CUDA device(s), cuda:0 .. cuda:0; use one of "
                               "them or leave --device out")
    check_cuda("cuda:1", 1, 2)  # in range: accepted
    check_cuda("cuda", None, 1)


@pytest.mark.gpu
def test_a_cuda_index_past_the_last_gpu_is_refused(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = torch.cuda.device_count()
    proc = _nmt("--model", str(tmp_path / "missing.pt"), "--device", f"cuda:{n}", stdin=b"Hello\n")
    assert proc.returncode == 1
    assert proc.stderr.decode().splitlines() == [
        f"error: --device cuda:{n}: this machine has {n} CUDA device(s), cuda:0 .. cuda:{n - 1}; use one of them "
        "or leave --device out"]


def test_truncated_model_file_is_a_checkpoint_error_with_path_and_remedy(model_file: Path, tmp_path: Path) -> None:
    broken = tmp_path / "averaged.pt"
    data = model_file.read_bytes()
    broken.write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=rf"{broken}: cannot be read .*truncated or corrupt: rerun `dvc repro "
                                              "average`"):
        load_translator(broken, "cpu")
    proc = _nmt("--model", str(broken), stdin=b"Hello\n")
    assert proc.returncode == 1
    assert f"error: {broken}: cannot be read" in proc.stderr.decode()
    with pytest.raises(CheckpointError, match="model file not found; run `dvc repro average`"):
        load_translator(tmp_path / "missing.pt", "cpu")


def test_input_is_normalised_like_training_text(model_file: Path) -> None:
    translator = load_translator(model_file, "cpu")
    messy = ["  Gutach:\u00a0Increased\tsafety \u200b", "Gutach: Increased safety"]
    out, sources, _, truncated = translate_lines(translator, messy, beam_size=2, max_len_b=5)
    assert sources[0] == sources[1] and out[0] == out[1] and not truncated
    assert out[0]


def test_read_input_splits_on_newline_only_and_reports_bad_lines() -> None:
    def read_input(stream: io.BytesIO) -> tuple[list[str], list[int]]:
        return decode_lines(split_lines(stream.read()))

    lines, bad = read_input(io.BytesIO(b"a\rb\n\n\xc3(\nend"))
    assert lines == ["a\rb", "", "\ufffd(", "end"] and bad == [3]
    assert read_input(io.BytesIO(b"")) == ([], [])
    assert read_input(io.BytesIO(b"\n")) == ([""], [])


@pytest.mark.slow
def test_flipped_bytes_in_the_model_file_are_refused_naming_file_and_remedy(model_file: Path, tmp_path: Path) -> None:
    from tests.helpers.corruption import flip_in_largest_record

    broken = tmp_path / "averaged.pt"
    broken.write_bytes(model_file.read_bytes())
    flip_in_largest_record(broken)
    expected = rf"{broken}: content does not match the sha256 recorded at save.*rerun `dvc repro average`"
    with pytest.raises(CheckpointError, match=expected):
        load_translator(broken, "cpu")
    proc = _nmt("--model", str(broken), stdin=b"Hello\n")
    assert proc.returncode == 1 and proc.stdout == b""
    assert f"error: {broken}: content does not match the sha256 recorded at save" in proc.stderr.decode()


@pytest.mark.parametrize("key", [None, "sha257"])
def test_a_model_file_without_a_recorded_sha256_is_refused_not_skipped(model_file: Path, tmp_path: Path,
                                                                       key: str | None) -> None:
    import torch

    from pipeline.artifacts import model_file as mf

    blob = torch.load(model_file, weights_only=True)
    weights = {name: tensor.clone() for name, tensor in blob["model"].items()}
    weights["embed.weight"][0] += 1.0  # flipped weights that a skipped check would accept
    old = tmp_path / "averaged.pt"
    torch.save({"model": weights, "config": blob["config"], "spm": blob["spm"],
                **({key: blob["sha256"]} if key else {})}, old)  # the key absent, or renamed by one byte
    with pytest.raises(CheckpointError) as info:
        mf.load(old)
    assert str(info.value) == (f"{old}: no 'sha256' key, so its content cannot be checked (written by an older "
                               "version, or edited); rerun `dvc repro average` (or copy the file again)")
    proc = _nmt("--model", str(old), stdin=b"Hello\n")
    assert proc.returncode == 1 and proc.stdout == b""
    assert proc.stderr.decode().splitlines() == [f"error: {info.value}"]


def test_a_file_that_is_not_a_model_is_named_without_torch_advice(tmp_path: Path) -> None:
    import pickle

    other = tmp_path / "averaged.pt"
    other.write_bytes(pickle.dumps({"model": Path("x")}))
    with pytest.raises(CheckpointError) as info:
        load_translator(other, "cpu")
    message = str(info.value)
    assert message.startswith(f"{other}: not a checkpoint written by this pipeline"), message
    assert "weights_only=False" not in message and "\n" not in message


def test_workers_without_ctranslate2_is_refused_before_any_work(model_file: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.de"
    assert main(["translate", "--model", str(model_file), "--input", str(model_file), "--output", str(out),
                 "--workers", "2"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: --workers 2: sets how many translations CTranslate2 runs at once; use it with --engine ctranslate2 "
        "(the torch engine runs one search at a time: --threads sets its threads)"]
    assert not out.exists()


@pytest.mark.parametrize(("option", "message"), [
    (["--engine", "ctranslate2", "--workers", "0"], "--workers: 0: must be an integer >= 1"),
    (["--threads", "-1"], "--threads: -1: must be an integer >= 0"),
    (["--max-tokens", "0"], "--max-tokens: 0: must be an integer >= 1"),
    (["--max-tokens", "many"], "--max-tokens: many: must be an integer >= 1"),
    (["--beam", "0"], "--beam: 0: must be an integer from 1 to 64 (the widest beam this project searches)"),
    (["--beam", "1000000"], "--beam: 1000000: must be an integer from 1 to 64 (the widest beam this project "
                            "searches)"),
    (["--alpha", "nan"], "--alpha: nan: must be a finite number"),
    (["--max-len-b", "inf"], "--max-len-b: inf: must be a finite number"),
])
def test_sizes_out_of_bounds_are_usage_errors_naming_the_option(model_file: Path, tmp_path: Path,
                                                                option: list[str], message: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by argparse (exit 2, one line naming the option) before any work."""
    out = tmp_path / "out.de"
    args = ["translate", "--model", str(model_file), "--input", str(model_file), "--output", str(out), *option]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"nmt translate: error: argument {message}; see nmt translate --help"], err
    assert not out.exists()


@pytest.mark.parametrize("what", ["missing", "empty folder", "folder holding averaged.pt"])
def test_a_model_path_that_is_missing_or_a_folder_is_one_line_saying_what_to_pass(
        model_file: Path, tmp_path: Path, what: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Once "not found" and "truncated or corrupt" together, or an IsADirectoryError traceback."""
    path = tmp_path / ("averaged.pt" if what == "missing" else "model")
    if what != "missing":
        path.mkdir()
    if what == "folder holding averaged.pt":
        (path / "averaged.pt").write_bytes(model_file.read_bytes())
    assert main(["translate", "--model", str(path), "--input", str(model_file)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    expected = {"missing": f"error: --model {path}: does not exist; pass an averaged.pt (`dvc repro average` writes ",
                "empty folder": f"error: --model {path}: is a folder, not an averaged.pt; pass an averaged.pt (",
                "folder holding averaged.pt": f"error: --model {path}: is a folder, not an averaged.pt; pass the model "
                                              f"file in it, {path / 'averaged.pt'}"}[what]
    assert lines[0].startswith(expected), lines
    assert "corrupt" not in lines[0]


@pytest.mark.parametrize(("option", "rule"), [([], "fairseq"), (["--beam-rule", "t2t"], "t2t")])
def test_the_beam_rule_reaches_the_search(model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          option: list[str], rule: str) -> None:
    from pipeline.inference import decoding

    seen, search = [], decoding.beam_search

    def spy(*args, **kwargs):  # the real search, its rule noted
        seen.append(kwargs["rule"])
        return search(*args, **kwargs)

    monkeypatch.setattr(decoding, "beam_search", spy)
    src = tmp_path / "in.en"
    src.write_text("The price is new.\n", encoding="utf-8")
    args = ["translate", "--model", str(model_file), "--input", str(src), "--output", str(tmp_path / "out.de")]
    assert main([*args, "--beam", "2", *option]) == 0
    assert seen == [rule]


@pytest.mark.slow
def test_a_beam_wider_than_the_models_vocabulary_is_refused_before_decoding(tmp_path: Path) -> None:
    """``--beam 301`` on a 300-piece model failed inside the search ("stack expects each tensor to be equal size")."""
    model = make_small_vocab_averaged(tmp_path / "small")
    src, out = tmp_path / "in.en", tmp_path / "out.de"
    src.write_text("a b c\n", encoding="utf-8")
    proc = _nmt("--model", str(model), "--input", str(src), "--output", str(out), "--beam", "17")
    assert proc.returncode == 1 and not out.exists()
    assert proc.stderr.decode().splitlines() == ["error: --beam 17: must be at most the vocabulary size (16 pieces): "
                                                 "a beam holds one hypothesis per distinct token"]
    assert _nmt("--model", str(model), "--input", str(src), "--output", str(out), "--beam", "16").returncode == 0

"""The CTranslate2 export: exact per-token scores against the torch model, and ``nmt translate --engine
ctranslate2`` behaving like the torch engine on edge inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from pipeline.core.errors import PipelineError
from pipeline.inference import ct2
from pipeline.inference.common import prepare_source
from pipeline.inference.decoding import load_translator
from tests.helpers.models import make_averaged
from tests.helpers.paths import REPO

PAIRS = [("Gutach: Increased safety for pedestrians", "Gutach: Noch mehr Sicherheit für Fußgänger"),
         ("They are not even 100 metres apart.", "Sie stehen keine 100 Meter voneinander entfernt."),
         ("The price is 3.50 euros.", "Der Preis liegt bei 3,50 Euro.")]
LONG = " ".join(["Gutach Sicherheit für Fußgänger"] * 1000)  # ~5,000 tokens, far beyond max_positions (64)


@pytest.fixture(scope="module", params=[False, True], ids=["post-norm", "pre-norm"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ct2")
    model = make_averaged(root, seed=5, n_layers=2, pre_norm=request.param)
    return model, ct2.export(model, root / "ct2")


def test_scores_equal_the_torch_models_per_token_log_probabilities(exported: tuple[Path, Path]) -> None:
    model, out = exported
    torch_tr, ct2_tr = load_translator(model, "cpu"), ct2.load(out)
    cfg = torch_tr.config
    for en, de in PAIRS:
        src_ids = torch_tr.sp.encode(en, out_type=int)
        tgt_ids = torch_tr.sp.encode(de, out_type=int)
        pieces = [[torch_tr.sp.id_to_piece(i) for i in ids] for ids in (src_ids, tgt_ids)]
        got = ct2_tr.translator.score_batch([pieces[0]], [pieces[1]])[0].log_probs  # CTranslate2 adds EOS
        src = torch.tensor([prepare_source(src_ids, cfg)[0]])
        tgt_in = torch.tensor([[cfg.bos_id, *tgt_ids]])
        with torch.no_grad():
            lprobs = torch_tr.model(src, tgt_in).log_softmax(-1)[0]
        want = [lprobs[i, t].item() for i, t in enumerate([*tgt_ids, cfg.eos_id])]
        assert got == pytest.approx(want, abs=1e-4)


def test_the_export_directory_is_complete_and_replaced_atomically(exported: tuple[Path, Path]) -> None:
    model, out = exported
    assert {"model.bin", "config.json", ct2.SPM_NAME, ct2.CONFIG_NAME} <= {p.name for p in out.iterdir()}
    assert json.loads((out / ct2.CONFIG_NAME).read_text()) == load_translator(model, "cpu").config.to_dict()
    again = ct2.export(model, out, "int8")
    assert again == out and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    ct2.export(model, out)  # back to float32 for the other tests


def _translate(*args: str, stdin: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "translate", "--max-tokens", "64", *args],
                          input=stdin, capture_output=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize("stdin", [b"", b"\n", LONG.encode() + b"\nThe price is new.\n"],
                         ids=["empty input", "one empty line", "5000-token line"])
@pytest.mark.slow
def test_translate_with_ctranslate2_behaves_like_the_torch_engine(exported: tuple[Path, Path], stdin: bytes) -> None:
    model, out = exported
    runs = {engine: _translate("--engine", engine, "--model", str(path), stdin=stdin)
            for engine, path in (("torch", model), ("ctranslate2", out))}
    for engine, proc in runs.items():
        assert proc.returncode == 0, (engine, proc.stderr.decode())
    lines = {engine: proc.stdout.decode().split("\n") for engine, proc in runs.items()}
    assert len(lines["torch"]) == len(lines["ctranslate2"])
    assert [bool(x) for x in lines["torch"]] == [bool(x) for x in lines["ctranslate2"]]
    warning = "1 line(s) longer than the model's max_positions (64 tokens with EOS) were truncated: line(s) 1"
    assert all((warning in proc.stderr.decode()) == (LONG.encode() in stdin) for proc in runs.values())


def test_translate_with_ctranslate2_never_imports_torch_and_any_workers_give_one_output(
        exported: tuple[Path, Path]) -> None:
    _, out = exported
    probe = ("import sys; from pipeline.cli import main; rc = main(sys.argv[1:]); "
             "sys.exit(9 if 'torch' in sys.modules else rc)")
    outputs = []
    for workers in ("1", "2"):
        proc = subprocess.run([sys.executable, "-c", probe, "translate", "--engine", "ctranslate2", "--model",
                               str(out), "--workers", workers], input="".join(en + "\n" for en, _ in PAIRS).encode(),
                              capture_output=True, timeout=120, cwd=REPO)
        assert proc.returncode == 0, (proc.returncode, proc.stderr.decode())  # 9: it imported torch
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1] and outputs[0].count(b"\n") == len(PAIRS)


def test_at_alpha_zero_the_engines_agree_on_this_model(exported: tuple[Path, Path], tmp_path: Path) -> None:
    model, out = exported
    src = tmp_path / "in.en"
    src.write_text("".join(en + "\n" for en, _ in PAIRS), encoding="utf-8")
    outputs = {}
    for engine, path in (("torch", model), ("ctranslate2", out)):
        dst = tmp_path / f"{engine}.de"
        assert main(["translate", "--engine", engine, "--model", str(path), "--input", str(src), "--output", str(dst),
                     "--alpha", "0", "--max-len-a", "0", "--max-len-b", "6"]) == 0
        outputs[engine] = dst.read_text(encoding="utf-8")
    assert outputs["torch"] == outputs["ctranslate2"]


def test_bad_exports_and_options_are_refused_naming_the_problem(exported: tuple[Path, Path], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    model, out = exported
    cfg = load_translator(model, "cpu").config
    pieces = ["<pad>", "<unk>", "<s>", "</s>", "a", "a"]
    problems = ct2.unsupported(cfg.__class__(**{**cfg.to_dict(), "pad_id": 1, "bos_id": 2, "eos_id": 3}), pieces)
    assert problems[0].startswith("model.pad_id is 1: CTranslate2 pads with id 0")
    assert any("duplicate pieces" in p for p in problems)
    swapped = ct2.unsupported(cfg.__class__(**{**cfg.to_dict(), "bos_id": 3, "eos_id": 2}), pieces[:4])
    assert swapped == ["model.bos_id: piece '</s>', but CTranslate2 starts and ends sentences with '<s>'",
                       "model.eos_id: piece '<s>', but CTranslate2 starts and ends sentences with '</s>'"]
    with pytest.raises(PipelineError, match="--quantization 'int4': choose one of float32, int8"):
        ct2.export(model, tmp_path / "x", "int4")
    assert main(["translate", "--engine", "ctranslate2", "--model", str(model), "--input", str(model)]) == 1
    err = capsys.readouterr().err
    assert (f"error: {model}: a file, not a CTranslate2 export folder; translate an averaged.pt with --engine torch, "
            f"or export it with `nmt export --format ctranslate2 --model {model} --output {model.parent}-ct2` and give "
            "that folder\n") in err
    assert main(["translate", "--engine", "ctranslate2", "--model", str(out), "--attention-png", "a.png"]) == 1
    assert "--attention-png draws the torch model's attention" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_missing_model_or_the_wrong_kind_of_path_is_one_line_with_a_folder_to_export_to(
        exported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing averaged.pt once drew the advice to export onto its own path."""
    model, out = exported
    missing = tmp_path / "averaged.pt"
    assert main(["translate", "--engine", "ctranslate2", "--model", str(missing)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {missing}: does not exist; give the folder `nmt export` wrote, or write one with `nmt export "
        f"--format ctranslate2 --model averaged.pt --output {tmp_path}-ct2`"]
    assert main(["translate", "--model", str(out)]) == 1  # an export, but --engine torch
    assert capsys.readouterr().err.splitlines() == [
        f"error: --model {out}: is a folder, not an averaged.pt; it holds a CTranslate2 export: nmt translate reads "
        "that with --engine ctranslate2"]
    assert main(["export", "--model", str(missing), "--output", str(tmp_path / "x")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --model {missing}: does not exist; pass an averaged.pt ")
    assert not (tmp_path / "x").exists()


def test_an_export_onto_a_file_is_refused_before_the_work_leaving_the_file(exported: tuple[Path, Path],
                                                                          tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    model, _ = exported
    target = tmp_path / "averaged.pt"
    target.write_bytes(b"a file of the user's\n")
    assert main(["export", "--model", str(model), "--output", str(target)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: --output {target}: is a file, left as it is; an export is a folder: name a new one, e.g. "
        f"{model.parent}-ct2"]
    assert main(["export", "--model", str(model), "--output", str(target / "ct2")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: --output {target / 'ct2'}: lies below the file {target}, left as it is; an export is a folder: name "
        f"a new one, e.g. {model.parent}-ct2"]
    assert target.read_bytes() == b"a file of the user's\n" and list(tmp_path.iterdir()) == [target]


def _copy(out: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(out, tmp_path / "export"))


def _flip(path: Path, n: int = 64) -> None:
    """Invert ``n`` bytes in the middle of ``path`` (same size, other weights)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    data[start:start + n] = bytes(b ^ 0xFF for b in data[start:start + n])
    path.write_bytes(bytes(data))


def _translate_error(folder: Path) -> list[str]:
    """``nmt translate --engine ctranslate2 --model folder``'s stderr lines (it must fail with no output)."""
    proc = _translate("--engine", "ctranslate2", "--model", str(folder), stdin=b"A man.\n")
    assert proc.returncode == 1 and proc.stdout == b"", proc.stderr.decode()
    return proc.stderr.decode().splitlines()


def test_the_export_records_the_size_and_sha256_of_every_file(exported: tuple[Path, Path]) -> None:
    import hashlib

    _, out = exported
    recorded = json.loads((out / "nmt_sha256.json").read_text())["files"]
    assert set(recorded) == {p.name for p in out.iterdir()} - {"nmt_sha256.json", ".nmt-output"}
    for name, entry in recorded.items():
        data = (out / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_an_output_marker_beside_the_files_is_neither_recorded_nor_refused(exported: tuple[Path, Path],
                                                                           tmp_path: Path) -> None:
    folder = _copy(exported[1], tmp_path)
    (folder / ".nmt-output").write_text("ctranslate2\n")  # what a folder writer may leave to mark its output
    assert ct2.check(folder) == folder


def test_flipped_bytes_in_model_bin_are_refused_in_one_line_naming_file_and_remedy(exported: tuple[Path, Path],
                                                                                   tmp_path: Path) -> None:
    folder = _copy(exported[1], tmp_path)
    _flip(folder / "model.bin")
    assert _translate_error(folder) == [
        f"error: {folder / 'model.bin'}: content does not match the sha256 in nmt_sha256.json (bit rot, a bad copy "
        f"or an edit?); export it again with `nmt export --format ctranslate2 --model averaged.pt --output {folder}`"]


@pytest.mark.parametrize(("damage", "message"), [
    ("no digest", "{d}: no nmt_sha256.json (the sha256 of every file, written at export), so its files cannot be "
                  "checked; export it again"),
    ("renamed key", "{d}/nmt_sha256.json: no files.model.bin.sha256 recorded, so model.bin cannot be checked; "
                    "export it again"),
    ("entry removed", "{d}/model.bin: not listed in nmt_sha256.json (added after the export?); export it again"),
    ("digest not JSON", "{d}/nmt_sha256.json: unreadable (JSONDecodeError); export it again"),
    ("file added", "{d}/shared_vocabulary.txt: not listed in nmt_sha256.json (added after the export?); export it "
                   "again"),
    ("truncated", "{d}/model.bin: truncated ("),
])
def test_a_missing_digest_or_key_is_an_error_not_a_skip(exported: tuple[Path, Path], tmp_path: Path, damage: str,
                                                        message: str) -> None:
    folder = _copy(exported[1], tmp_path)
    digest = folder / "nmt_sha256.json"
    recorded = json.loads(digest.read_text())
    _flip(folder / "model.bin")  # what a skipped check would let through
    if damage == "no digest":
        digest.unlink()
    elif damage == "renamed key":  # one byte of the digest changed
        entry = recorded["files"]["model.bin"]
        entry["sha257"] = entry.pop("sha256")
        digest.write_text(json.dumps(recorded))
    elif damage == "entry removed":
        del recorded["files"]["model.bin"]
        digest.write_text(json.dumps(recorded))
    elif damage == "digest not JSON":
        digest.write_text("{")
    elif damage == "file added":
        (folder / "shared_vocabulary.txt").write_text("a\n")
    else:
        data = (folder / "model.bin").read_bytes()
        (folder / "model.bin").write_bytes(data[: len(data) // 2])
    lines = _translate_error(folder)
    assert len(lines) == 1 and lines[0].startswith("error: " + message.format(d=folder)), lines


@pytest.mark.parametrize("oddity", ["missing folder", "a file", "averaged.pt", "no model.bin", "path below a file"])
def test_odd_paths_are_one_line(exported: tuple[Path, Path], tmp_path: Path, oddity: str) -> None:
    model, out = exported
    folder = {"missing folder": tmp_path / "nowhere", "averaged.pt": model, "path below a file": model / "x"}.get(
        oddity, tmp_path / "export")
    if oddity == "a file":
        folder.write_text("not an export\n")
    elif oddity == "no model.bin":
        _copy(out, tmp_path)
        (folder / "model.bin").unlink()
    lines = _translate_error(folder)
    assert len(lines) == 1 and lines[0].startswith(f"error: {folder}: "), lines
    assert "nmt export --format ctranslate2 --model " in lines[0]


@pytest.mark.parametrize("damage", ["model.bin", "nmt_model.json", "spm.model"])
def test_a_damaged_file_recorded_in_a_new_digest_is_still_one_line(exported: tuple[Path, Path], tmp_path: Path,
                                                                    damage: str) -> None:
    from pipeline.inference import digest

    folder = _copy(exported[1], tmp_path)
    data = (folder / damage).read_bytes()
    (folder / damage).write_bytes(data[: len(data) // 2] if damage != "nmt_model.json" else b'{"d_model": "x"}')
    digest.write(folder)  # as if the export had been written so
    lines = _translate_error(folder)
    where = folder / damage if damage == "nmt_model.json" else folder
    assert len(lines) == 1 and lines[0].startswith(f"error: {where}: "), lines
    assert lines[0].endswith(f"export it again with `nmt export --format ctranslate2 --model averaged.pt --output "
                             f"{folder}`")


def test_the_served_model_refuses_a_damaged_export_naming_the_file(exported: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    from mlflow.pyfunc import PythonModelContext

    from pipeline.tracking.pyfunc import Translator

    model, out = exported
    folder = _copy(out, tmp_path)
    _flip(folder / "model.bin")
    with pytest.raises(PipelineError) as info:
        Translator().load_context(PythonModelContext({"averaged": str(model), "ctranslate2": str(folder)}, {}))
    message = str(info.value)
    assert message.startswith(f"{folder / 'model.bin'}: content does not match the sha256 in nmt_sha256.json")
    assert "register the model again" in message and "\n" not in message

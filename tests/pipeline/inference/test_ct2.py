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
from pipeline.inference.decoding import load_translator, prepare_source
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
    assert f"{model}: not a CTranslate2 export (model.bin, spm.model, nmt_model.json missing)" in err
    assert main(["translate", "--engine", "ctranslate2", "--model", str(out), "--attention-png", "a.png"]) == 1
    assert "--attention-png draws the torch model's attention" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

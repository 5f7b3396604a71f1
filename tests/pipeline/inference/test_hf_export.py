"""The Hugging Face export: MarianMT's classes holding our weights give our logits, our greedy outputs and (through
``pipeline("translation")``) ``nmt translate --beam 1``'s text; an empty best hypothesis comes out of every engine."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from model.config import max_length
from pipeline.artifacts.model_file import NAME as AVERAGED_NAME
from pipeline.average import stage
from pipeline.cli import main
from pipeline.core.config import AverageConfig
from pipeline.inference import ct2, hf_export
from pipeline.inference.common import prepare_source
from pipeline.inference.decoding import load_translator
from pipeline.inference.translate import translate_lines
from pipeline.tracking.harness import run_stage
from tests.helpers.models import make_averaged, make_spm, spm_vocab_size, tiny_model, write_checkpoint
from tests.helpers.paths import REPO

transformers = pytest.importorskip("transformers", reason="the hf extra (make install) installs transformers")

LINES = ["Gutach: Increased safety for pedestrians", "They are not even 100 metres apart.",
         "The price is 3.50 euros, the e-mail address is new.", "Öl, Ärger QXZJVWY!", "Two"]
MAX_LEN_A, MAX_LEN_B = 1.0, 50.0  # nmt translate's defaults


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hf")
    model = make_averaged(root, seed=5, n_layers=2)
    return model, hf_export.export(model, root / "hf")


def _limit(source: list[int], max_positions: int) -> int:
    """model/beam.py's max_len for a model source (ids + EOS), capped as pipeline/inference/decoding.py caps it."""
    return min(max_length(len(source), MAX_LEN_A, MAX_LEN_B), max_positions)


def test_the_exported_logits_equal_ours_in_float32(exported: tuple[Path, Path]) -> None:
    model, out = exported
    ours = load_translator(model, "cpu")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "MarianMTModel" and type(tok).__name__ == "MarianTokenizer"
    enc = tok(LINES, return_tensors="pt", padding=True)
    src = enc.input_ids.masked_fill(enc.attention_mask.eq(0), ours.config.pad_id)
    for line, row, mask in zip(LINES, enc.input_ids, enc.attention_mask):
        assert row[mask.bool()].tolist() == [*ours.sp.encode(line), ours.config.eos_id]  # same ids, same EOS
    long = " ".join(LINES * 10)  # beyond max_positions (64): cut as nmt translate cuts it, EOS last
    assert tok(long, truncation=True).input_ids == prepare_source(ours.sp.encode(long), ours.config)[0]
    tgt_in = torch.randint(4, ours.config.vocab_size, (len(LINES), 9), generator=torch.Generator().manual_seed(0))
    tgt_in[:, 0] = ours.config.bos_id
    with torch.no_grad():
        want = ours.model(src, tgt_in)
        got = theirs(input_ids=enc.input_ids, attention_mask=enc.attention_mask, decoder_input_ids=tgt_in).logits
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_greedy_outputs_and_the_translation_pipeline_equal_nmt_translate_beam_1(exported: tuple[Path, Path],
                                                                                tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture) -> None:
    model, out = exported
    ours = load_translator(model, "cpu")
    _, sources, hyps, _ = translate_lines(ours, LINES, beam_size=1, max_len_a=MAX_LEN_A, max_len_b=MAX_LEN_B)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    (tmp_path / "in.en").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    assert main(["translate", "--model", str(model), "--beam", "1", "--input", str(tmp_path / "in.en"),
                 "--output", str(tmp_path / "out.de")]) == 0
    cli = (tmp_path / "out.de").read_text(encoding="utf-8").splitlines()
    translate = transformers.pipeline("translation", model=str(out), device="cpu")
    for line, source, hyp, text in zip(LINES, sources, hyps, cli, strict=True):
        limit = _limit(source, ours.config.max_positions)
        with torch.no_grad():
            ids = theirs.generate(**tok(line, return_tensors="pt"), num_beams=1, do_sample=False,
                                  max_new_tokens=limit)[0].tolist()
        assert ids[0] == ours.config.bos_id
        assert [t for t in ids[1:] if t != ours.config.eos_id] == hyp  # at most EOS after the ids
        assert translate(line, num_beams=1, max_new_tokens=limit)[0]["translation_text"] == text


def test_the_folder_is_complete_and_its_card_written(exported: tuple[Path, Path]) -> None:
    _, out = exported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "source.spm", "target.spm", "vocab.json",
            "tokenizer_config.json", "README.md", "nmt_sha256.json"} <= names
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["num_beams"] == 4 and generation["decoder_start_token_id"] == 2
    assert generation["max_length"] == 64 and generation["suppress_tokens"] == [0, 2]  # max_positions; pad, BOS
    assert "forced_eos_token_id" not in generation or generation["forced_eos_token_id"] is None
    assert "No run records found" in (out / "README.md").read_text()


def test_the_card_reports_the_runs_records(tmp_path: Path) -> None:
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    model = make_averaged(tmp_path / "build", seed=1)
    (tmp_path / "runs/demo/model").mkdir(parents=True)
    shutil.copy(model, tmp_path / "runs/demo/model" / AVERAGED_NAME)
    (tmp_path / "metrics/demo").mkdir(parents=True)
    signature = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.5.1"
    figures = {"bleu": 12.5, "sentences": 1014, "signatures": {"bleu": signature}}
    (tmp_path / "metrics/demo/evaluate.details.json").write_text(json.dumps(
        {"valid": figures, "test": {**figures, "bleu": 11.25}, "chosen": {"beam": 4, "alpha": 0.6}}))
    (tmp_path / "metrics/demo/train.details.json").write_text(json.dumps({"step": 700}))
    (tmp_path / "reports/demo").mkdir(parents=True)
    (tmp_path / "reports/demo/audit.json").write_text(json.dumps(
        {"deviations": ["data: 29,000 training pairs (paper: ~4.5M)"], "lineage": {"git": {"commit": "abc123"}}}))
    out = hf_export.export(tmp_path / "runs/demo/model" / AVERAGED_NAME, tmp_path / "hf")
    card = (out / "README.md").read_text(encoding="utf-8")
    for want in ("profile: `demo`", "Multi30k: non-commercial", "700 steps", "valid BLEU: 12.50", "test BLEU: 11.25",
                 signature, "- data: 29,000 training pairs (paper: ~4.5M)", "commit: `abc123` (the audit's record"):
        assert want in card, want


def _eos_first(root: Path) -> Path:
    """An averaged.pt whose decoder always puts nearly all probability on EOS: the best hypothesis is empty."""
    spm_model = make_spm(root / "bpe")
    model = tiny_model(spm_vocab_size(spm_model), 3, n_layers=1)
    cfg = model.cfg
    with torch.no_grad():
        model.embed.weight[cfg.eos_id] *= 5
        direction = model.embed.weight[cfg.eos_id] / model.embed.weight[cfg.eos_id].norm()
        norm = model.decoder[-1].res_ffn.norm
        norm.weight.zero_()
        norm.bias.copy_(10 * direction)  # the decoder's output is this vector at every step
    write_checkpoint(root / "train", 10, model.state_dict(), cfg.to_dict())
    run_stage("average", lambda: stage(AverageConfig(last_n=1), train_dir=root / "train", bpe_dir=root / "bpe",
                                       model_dir=root / "model"), metrics_dir=root / "metrics")
    return root / "model" / AVERAGED_NAME


def test_an_empty_best_hypothesis_comes_out_of_every_engine(tmp_path: Path) -> None:
    model = _eos_first(tmp_path)
    ours = load_translator(model, "cpu")
    exported = ct2.load(ct2.export(model, tmp_path / "ct2"))
    out = hf_export.export(model, tmp_path / "hf")
    for beam, alpha in ((1, 0.0), (4, 0.0), (4, 0.6)):
        texts = {name: translate_lines(engine, LINES, beam_size=beam, alpha=alpha)[0]
                 for name, engine in (("torch", ours), ("ctranslate2", exported))}
        assert texts["torch"] == texts["ctranslate2"] == [""] * len(LINES), (beam, alpha, texts)
    translate = transformers.pipeline("translation", model=str(out), device="cpu")
    assert [r["translation_text"] for r in translate(LINES, num_beams=1)] == [""] * len(LINES)


def test_without_transformers_the_export_is_one_line_naming_the_install(exported: tuple[Path, Path],
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture) -> None:
    model, _ = exported
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert main(["export", "--format", "hf", "--model", str(model), "--output", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install" in err and ".[hf]" in err, err
    assert not (tmp_path / "hf").exists()


def test_the_output_rules_are_the_ctranslate2_exports(exported: tuple[Path, Path], tmp_path: Path) -> None:
    model, out = exported
    assert hf_export.export(model, out) == out  # its own export is replaced
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(Exception, match="mine"):
        hf_export.export(model, foreign)
    assert (foreign / "notes.txt").read_text() == "keep" and len(list(foreign.iterdir())) == 1
    (tmp_path / "file").write_text("keep")
    with pytest.raises(Exception, match="is a file"):
        hf_export.export(model, tmp_path / "file")
    ct2_out = ct2.export(model, tmp_path / "ct2")
    with pytest.raises(Exception, match="ct2"):  # another format's export is not this one's to replace
        hf_export.export(model, ct2_out)
    assert (ct2_out / "model.bin").is_file()


def test_ctranslate2s_own_converter_refuses_the_export_so_ct2_builds_its_spec(exported: tuple[Path, Path],
                                                                              tmp_path: Path) -> None:
    """CTranslate2's Marian loader (ctranslate2/converters/transformers.py) drops the last vocabulary row, where
    Marian keeps ``<pad>`` (ours is id 0), and starts the decoder from a zero vector (ours: BOS's embedding). When
    this fails, the converter takes the folder: compare its outputs with ct2.export's before replacing the latter."""
    import ctranslate2

    _, out = exported
    with pytest.raises(ValueError, match="vocabulary of size"):
        ctranslate2.converters.TransformersConverter(str(out)).convert(str(tmp_path / "converted"))


def test_nmt_export_format_hf_writes_the_folder_and_refuses_a_quantization(exported: tuple[Path, Path],
                                                                           tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    model, _ = exported
    assert main(["export", "--format", "hf", "--model", str(model), "--output", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert main(["export", "--format", "hf", "--quantization", "int8", "--model", str(model), "--output",
                 str(tmp_path / "other")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quantization int8" in err[0] and not (tmp_path / "other").exists()


def test_a_pre_norm_model_is_refused_in_one_line_naming_the_key(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    model = make_averaged(tmp_path / "pre", seed=2, pre_norm=True)
    assert main(["export", "--format", "hf", "--model", str(model), "--output", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.pre_norm" in err[0] and "--format ctranslate2" in err[0], err
    assert not (tmp_path / "hf").exists()

"""A tiny model to test with: a real SentencePiece model trained by the bpe stage's trainer on a
small EN/DE corpus, a random tiny Transformer, checkpoints as the train stage writes them, and a
complete ``averaged.pt`` built by the average stage itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch

from model import Transformer, TransformerConfig
from pipeline.artifacts.model_file import NAME as AVERAGED_NAME
from pipeline.average import stage
from pipeline.bpe import train_model
from pipeline.core.config import AverageConfig, BpeConfig
from pipeline.tracking.harness import run_stage

TINY_MODEL = {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1, "dropout": 0.0, "attn_dropout": 0.0,
              "ffn_dropout": 0.0, "pre_norm": False, "max_positions": 64}
CORPUS = [
    "Gutach: Noch mehr Sicherheit für Fußgänger",
    "Gutach: Increased safety for pedestrians",
    "Sie stehen keine 100 Meter voneinander entfernt.",
    "They are not even 100 metres apart.",
    "Am Dienstag ist die neue Ampel in Betrieb genommen worden.",
    "On Tuesday, the new traffic lights were put into operation.",
    "Zwei Anlagen so nah beieinander: Absicht oder Schildbürgerstreich?",
    "Two sets of lights so close to one another: intentional or just a silly error?",
    "Diese Frage hat der Bürgermeister gestern klar beantwortet.",
    "Yesterday, the mayor gave a clear answer to this question.",
    "Der Preis liegt bei 3,50 Euro, die E-Mail-Adresse ist neu.",
    "The price is 3.50 euros, the e-mail address is new.",
    "Öl, Ärger, Übung, Straße; quick brown fox jumps over the lazy dog QXZJVWY!",
] * 4


def make_spm(directory: Path, vocab_size: int = 120) -> Path:
    """Train a real joint BPE model (pad=0 unk=1 bos=2 eos=3) on :data:`CORPUS`; returns spm.model."""
    directory.mkdir(parents=True, exist_ok=True)
    sample = directory / "sample.txt"
    sample.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
    train_model(sample, directory / "spm", BpeConfig(vocab_size=vocab_size, input_sentence_size=0), 1)
    sample.unlink()
    return directory / "spm.model"


def spm_vocab_size(spm_model: Path) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(spm_model)).get_piece_size()


def tiny_model(vocab_size: int, seed: int, **overrides: object) -> Transformer:
    """A random tiny Transformer (deterministic for a seed)."""
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=vocab_size, **{**TINY_MODEL, **overrides})
    return Transformer(cfg).eval()


def write_checkpoint(train_dir: Path, step: int, state_dict: dict[str, torch.Tensor],
                     model_section: dict | None = None, done: bool = True) -> Path:
    """A checkpoint folder as the train stage writes it (model.pt, state.json recording its size and sha256,
    DONE last)."""
    folder = train_dir / f"step-{step:08d}"
    folder.mkdir(parents=True)
    torch.save(state_dict, folder / "model.pt")
    data = (folder / "model.pt").read_bytes()
    state = {"step": step, "config": {"model": model_section or TINY_MODEL, "train": {}, "seed": 1},
             "files": {"model.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    (folder / "state.json").write_text(json.dumps(state), encoding="utf-8")
    if done:
        (folder / "DONE").write_text("", encoding="utf-8")
    return folder


def make_averaged(root: Path, seed: int = 0, **overrides: object) -> Path:
    """A complete ``averaged.pt`` for a random tiny model, built by the average stage itself."""
    spm_model = make_spm(root / "bpe")
    model = tiny_model(spm_vocab_size(spm_model), seed, **overrides)
    write_checkpoint(root / "train", 10, model.state_dict(), model.cfg.to_dict())  # as the train stage does
    run_stage("average", lambda: stage(AverageConfig(last_n=1), train_dir=root / "train", bpe_dir=root / "bpe",
                                       model_dir=root / "model"), metrics_dir=root / "metrics")
    return root / "model" / AVERAGED_NAME


def make_small_vocab_averaged(root: Path, seed: int = 0) -> Path:
    """An ``averaged.pt`` like :func:`make_averaged`'s whose BPE model has 16 pieces, fewer than
    ``model.config.MAX_BEAM_SIZE`` (learnt from three letters), to test beams wider than the vocabulary."""
    (root / "bpe").mkdir(parents=True)
    sample = root / "sample.txt"
    sample.write_text("\n".join(["ab ba abc cab", "bac cba a b c"] * 20) + "\n", encoding="utf-8")
    train_model(sample, root / "bpe" / "spm", BpeConfig(vocab_size=16, input_sentence_size=0), 1)
    sample.unlink()
    model = tiny_model(spm_vocab_size(root / "bpe" / "spm.model"), seed)
    write_checkpoint(root / "train", 10, model.state_dict(), model.cfg.to_dict())
    run_stage("average", lambda: stage(AverageConfig(last_n=1), train_dir=root / "train", bpe_dir=root / "bpe",
                                       model_dir=root / "model"), metrics_dir=root / "metrics")
    return root / "model" / AVERAGED_NAME


@functools.cache
def trained_reverser(seed: int = 0, steps: int = 400) -> Transformer:
    """A tiny float64 Transformer trained (in fp32, a few seconds) to reverse sequences of ids 4..12:
    its outputs end with EOS at realistic lengths, unlike a random model's, which run to max_len.
    Cached: callers must not change it."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=13, d_model=32, n_heads=2, d_ff=64, n_layers=2, dropout=0.0,
                            attn_dropout=0.0, ffn_dropout=0.0, max_positions=64)
    model = Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        n = int(torch.randint(2, 8, (1,), generator=g))
        body = torch.randint(4, 13, (32, n), generator=g)
        eos = torch.full((32, 1), cfg.eos_id)
        src = torch.cat([body, eos], 1)
        tgt = torch.cat([body.flip(1), eos], 1)
        tgt_in = torch.cat([torch.full((32, 1), cfg.bos_id), tgt[:, :-1]], 1)
        loss = torch.nn.functional.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.double().eval()

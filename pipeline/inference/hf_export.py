"""Hugging Face ``transformers`` export: an ``averaged.pt`` as a MarianMT folder (``from_pretrained``, ``pipeline``).

Our post-norm network is MarianMT's (transformers/models/marian/modeling_marian.py): ReLU feed-forward, static
sinusoids, one embedding shared three ways and scaled by sqrt(d_model), biases on every projection, LayerNorm eps
1e-5. The one difference is the sinusoid's layout: ours interleaves sin and cos (the paper's PE[p, 2i],
PE[p, 2i + 1]), Marian's ``MarianSinusoidalPositionalEmbedding`` puts the sines first and the cosines second, with
the same frequencies. Reordering the model dimension by :func:`permutation` in every weight that reads or writes
the residual stream maps one model onto the other exactly: attention scores, the feed-forward hidden units and
LayerNorm's statistics do not depend on the order of the residual dimensions.

The tokenizer is ``MarianTokenizer`` on our SentencePiece model, with a vocab.json that maps every piece to its own
id, so ids, ``<pad>``, ``<unk>`` and ``</s>`` are ours; generation starts from our BOS (``decoder_start_token_id``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from model.config import UNK_ID, TransformerConfig
from pipeline.core.errors import PipelineError
from pipeline.core.owned import atomic_path
from pipeline.inference import ct2, digest, model_card

log = logging.getLogger(__name__)

#: The role an export folder's marker names (pipeline/core/owned.py): only such a folder is replaced.
EXPORT_ROLE = "hugging face export"
#: What to install when ``transformers`` is missing (pyproject.toml's optional extra).
INSTALL = "pip install -c constraints.txt -e '.[hf]' in the checkout (make install does)"
#: The paper's beam (§6.1); transformers' length penalty is its own (generation's length_penalty), not GNMT's.
BEAM = 4
#: The special pieces MarianTokenizer names by default (tokenization_marian.py), as our BPE model holds them.
PIECES = {"pad_id": "<pad>", "unk_id": "<unk>", "eos_id": "</s>"}


def transformers_module() -> Any:
    """``transformers``, or a one-line PipelineError saying what to install."""
    try:
        import transformers
    except ImportError as exc:
        raise PipelineError(f"nmt export --format hf: needs the transformers package ({exc.msg}); install it with "
                            f"{INSTALL}") from None
    return transformers


def default_output(model_path: str | Path) -> Path:
    """``<the model's folder>-hf``, as :func:`pipeline.inference.ct2.default_output` names ``-ct2``."""
    ct2_path = ct2.default_output(model_path)
    return ct2_path.with_name(ct2_path.name.removesuffix("-ct2") + "-hf")


def unsupported(config: TransformerConfig, pieces: list[str]) -> list[str]:
    """What MarianMT cannot represent of this model, one message per key (empty: exportable)."""
    problems = []
    if config.pre_norm:
        problems.append("model.pre_norm is true: MarianMT's layers are post-norm, with no final LayerNorm")
    if config.d_model % 2:
        problems.append(f"model.d_model is {config.d_model}: the sinusoids' halves need an even width")
    for key, want in PIECES.items():
        index = UNK_ID if key == "unk_id" else getattr(config, key)
        if (pieces[index] if index < len(pieces) else None) != want:
            problems.append(f"{key}: piece {pieces[index] if index < len(pieces) else None!r}, but MarianTokenizer "
                            f"names {want!r}")
    if len(set(pieces)) != len(pieces):
        problems.append("bpe: the SentencePiece model has duplicate pieces; vocab.json maps pieces to ids")
    return problems


def permutation(d_model: int) -> torch.Tensor:
    """Marian's dimension j holds ours ``permutation(d)[j]``: even (sine) dimensions first, then odd (cosine)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_config(transformers: Any, cfg: TransformerConfig) -> Any:
    """The ``MarianConfig`` of our config: sizes, ids, ReLU, scaled shared embeddings, dropouts (inert in eval)."""
    return transformers.MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_positions,
        encoder_layers=cfg.n_layers, decoder_layers=cfg.n_layers, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
        encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads, d_model=cfg.d_model,
        activation_function="relu", dropout=cfg.dropout, attention_dropout=cfg.attn_dropout,
        activation_dropout=cfg.ffn_dropout, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id, bos_token_id=cfg.bos_id,
        decoder_start_token_id=cfg.bos_id, forced_eos_token_id=None)


def marian_weights(state: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """Our ``Transformer`` state dict as MarianMTModel's (``model.`` names), the model dimension permuted."""
    p, d = permutation(cfg.d_model), cfg.d_model
    rows = lambda w: w.index_select(0, p)  # noqa: E731 - writes the residual stream (output rows)
    cols = lambda w: w.index_select(1, p)  # noqa: E731 - reads the residual stream (input columns)
    out = {"model.shared.weight": cols(state["embed.weight"])}

    def attention(prefix: str, ours: str, fused: str, names: tuple[str, ...]) -> None:
        weight, bias = cols(state[f"{ours}.{fused}.weight"]), state[f"{ours}.{fused}.bias"]
        for i, name in enumerate(names):  # the fused projection's blocks, in this order
            part = slice(i * d, (i + 1) * d)
            out[f"{prefix}.{name}.weight"], out[f"{prefix}.{name}.bias"] = weight[part], bias[part]

    def linear(target: str, source: str, *, reads: bool) -> None:  # reads the residual stream, else writes it
        weight, bias = state[f"{source}.weight"], state[f"{source}.bias"]
        out[f"{target}.weight"] = cols(weight) if reads else rows(weight)
        out[f"{target}.bias"] = bias if reads else bias.index_select(0, p)

    def norm(target: str, source: str) -> None:
        out[f"{target}.weight"], out[f"{target}.bias"] = (state[f"{source}.{k}"].index_select(0, p)
                                                          for k in ("weight", "bias"))

    for stack in ("encoder", "decoder"):
        for i in range(cfg.n_layers):
            ours, theirs = f"{stack}.{i}", f"model.{stack}.layers.{i}"
            attention(f"{theirs}.self_attn", ours, "self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"))
            linear(f"{theirs}.self_attn.out_proj", f"{ours}.self_attn.out_proj", reads=False)
            norm(f"{theirs}.self_attn_layer_norm", f"{ours}.{'res_attn' if stack == 'encoder' else 'res_self'}.norm")
            if stack == "decoder":
                linear(f"{theirs}.encoder_attn.q_proj", f"{ours}.cross_attn.q_proj", reads=True)
                attention(f"{theirs}.encoder_attn", ours, "cross_attn.kv_proj", ("k_proj", "v_proj"))
                linear(f"{theirs}.encoder_attn.out_proj", f"{ours}.cross_attn.out_proj", reads=False)
                norm(f"{theirs}.encoder_attn_layer_norm", f"{ours}.res_cross.norm")
            linear(f"{theirs}.fc1", f"{ours}.ffn.fc1", reads=True)
            linear(f"{theirs}.fc2", f"{ours}.ffn.fc2", reads=False)
            norm(f"{theirs}.final_layer_norm", f"{ours}.res_ffn.norm")
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def _write_tokenizer(transformers: Any, folder: Path, spm_bytes: bytes, pieces: list[str],
                     cfg: TransformerConfig) -> None:
    for name in ("source.spm", "target.spm"):
        (folder / name).write_bytes(spm_bytes)
    (folder / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False,
                                                  indent=0) + "\n", encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(str(folder / "source.spm"), str(folder / "target.spm"),
                                             str(folder / "vocab.json"), source_lang="en", target_lang="de",
                                             model_max_length=cfg.max_positions)
    tokenizer.save_pretrained(str(folder))


def build_model(transformers: Any, state: dict[str, torch.Tensor], cfg: TransformerConfig) -> Any:
    """A MarianMTModel (eval mode) holding our weights, with the generation config :func:`export` writes."""
    model = transformers.MarianMTModel(marian_config(transformers, cfg))
    missing, unexpected = model.load_state_dict(marian_weights(state, cfg), strict=False)
    left = [k for k in missing if "embed_positions" not in k and "embed_tokens" not in k
            and k not in ("lm_head.weight", "final_logits_bias")]
    if left or unexpected:
        raise PipelineError(f"the MarianMT mapping is incomplete (missing {left}, unexpected {unexpected}); "
                            "this transformers version's Marian differs from the one this code maps onto")
    model.tie_weights()
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=cfg.bos_id, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id,
        pad_token_id=cfg.pad_id, forced_eos_token_id=None, num_beams=BEAM, max_length=cfg.max_positions,
        suppress_tokens=sorted({cfg.pad_id, cfg.bos_id}))  # model/beam.py bans both
    return model.eval()


def export(model_path: str | Path, output: str | Path) -> Path:
    """Write a ``transformers`` MarianMT folder for an ``averaged.pt`` (weights as safetensors, a model card).

    Raises:
        PipelineError: no transformers, a model MarianMT cannot represent, an unreadable model, a refused output.
    """
    import sentencepiece as spm

    from pipeline.artifacts import model_file

    transformers = transformers_module()
    output = Path(output)
    ct2.check_output(output, model_path, default_output(model_path))
    mf = model_file.load(model_path)
    sp = spm.SentencePieceProcessor(model_proto=mf.spm)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if problems := unsupported(mf.config, pieces):
        raise PipelineError(f"{model_path}: cannot export to MarianMT: " + "; ".join(problems)
                            + "; `nmt export --format ctranslate2` takes it")
    model_file.build_model(mf, model_path)  # the weights fit the config (a named error if not)
    model = build_model(transformers, mf.weights, mf.config)
    card = model_card.render(Path(model_path), mf.config)
    with atomic_path(output, role=EXPORT_ROLE, option="--output") as tmp:  # replaces only an export it wrote
        model.save_pretrained(str(tmp), safe_serialization=True)
        _write_tokenizer(transformers, tmp, mf.spm, pieces, mf.config)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        digest.write(tmp)  # last: it records every file above
    log.info("exported %s to %s (transformers MarianMT)", model_path, output)
    return output

"""CTranslate2 (https://opennmt.net/CTranslate2/): export an ``averaged.pt`` and translate with the export.

The export carries a digest (:mod:`pipeline.inference.digest`) checked before CTranslate2 reads anything. Its length
penalty is length^α, not GNMT's, so outputs match the torch engine's only at α = 0 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.config import TransformerConfig, max_length
from pipeline.core.config import load_params
from pipeline.core.errors import PipelineError
from pipeline.core.owned import atomic_path
from pipeline.core.paths import output_problem
from pipeline.inference import digest

log = logging.getLogger(__name__)

SPM_NAME = "spm.model"
CONFIG_NAME = "nmt_model.json"
QUANTIZATIONS = ("float32", "int8", "int8_float32", "float16")
#: The role an export folder's marker names (pipeline/core/owned.py): only such a folder is replaced.
EXPORT_ROLE = "ctranslate2 export"
#: The layer-norm epsilon of torch.nn.LayerNorm (CTranslate2's default differs).
LAYER_NORM_EPS = 1e-5
#: The average stage's model file (pipeline/artifacts/model_file.py's NAME; that module imports torch).
AVERAGED = "averaged.pt"


def default_output(model_path: str | Path) -> Path:
    """The folder the errors suggest exporting ``model_path`` into: ``<its folder>-ct2`` (beside the model folder,
    not in it); ``<name>-ct2`` beside a file in ``.`` or ``/``."""
    model_path = Path(model_path)
    folder = model_path.parent
    return Path(f"{folder}-ct2") if folder.name else model_path.with_name(f"{model_path.stem}-ct2")


def file_in(path: Path) -> Path | None:
    """``path`` or the folder above it that exists and is not a folder (a file), if any."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def check_output(output: Path, model_path: str | Path, suggested: Path) -> None:
    """Refuse, before any work, an export ``output`` that is no place for it (``suggested``: the folder to name).

    Raises:
        PipelineError: ``output`` holds an input or a folder the project did not write, or is (or lies below) a file.
    """
    if problem := output_problem(output, inputs=[model_path]):
        raise PipelineError(f"--output {output}: refusing to write there: {problem}; name a new folder, e.g. "
                            f"{suggested}")
    if blocker := file_in(output):  # never replaced
        where = "is a file" if blocker == output else f"lies below the file {blocker}"
        raise PipelineError(f"--output {output}: {where}, left as it is; an export is a folder: name a new one, "
                            f"e.g. {suggested}")


def _where_averaged() -> str:
    """Where ``dvc repro average`` writes the model for ./params.yaml (or for a params.yaml, if that is unreadable)."""
    try:
        return f"`dvc repro average` writes {Path(load_params().paths.model) / AVERAGED} for this params.yaml"
    except (PipelineError, OSError):
        return f"`dvc repro average` writes <paths.model>/{AVERAGED} for a params.yaml"


def check_averaged(model: str | Path) -> Path:
    """``--model`` of ``nmt export`` and ``nmt translate --engine torch``, if it exists and is not a folder.

    Raises:
        PipelineError: one line naming ``--model``, what it is and what to pass instead.
    """
    model = Path(model)
    if model.is_dir():
        if (model / AVERAGED).is_file():
            hint = f"pass the model file in it, {model / AVERAGED}"
        elif (model / "model.bin").is_file():
            hint = "it holds a CTranslate2 export: nmt translate reads that with --engine ctranslate2"
        else:
            hint = f"pass an {AVERAGED} ({_where_averaged()})"
        raise PipelineError(f"--model {model}: is a folder, not an {AVERAGED}; {hint}")
    if not model.exists():
        raise PipelineError(f"--model {model}: does not exist; pass an {AVERAGED} ({_where_averaged()})")
    return model


def unsupported(config: TransformerConfig, pieces: Sequence[str]) -> list[str]:
    """What CTranslate2 cannot represent of this model, one message per key (empty: exportable)."""
    problems = []
    if config.pad_id != 0:
        problems.append(f"model.pad_id is {config.pad_id}: CTranslate2 pads with id 0; retrain the BPE model "
                        "with pad_id 0 (pipeline/bpe.py does)")
    if len(set(pieces)) != len(pieces):
        problems.append("bpe: the SentencePiece model has duplicate pieces; CTranslate2 maps tokens by piece")
    for key, want in (("bos_id", "<s>"), ("eos_id", "</s>")):
        got = pieces[getattr(config, key)] if getattr(config, key) < len(pieces) else None
        if got != want:
            problems.append(f"model.{key}: piece {got!r}, but CTranslate2 starts and ends sentences with {want!r}")
    return problems


def _set_linear(spec: Any, linear: Any) -> None:
    spec.weight = linear.weight.detach().float().numpy()
    if linear.bias is not None:
        spec.bias = linear.bias.detach().float().numpy()


def _set_norm(spec: Any, norm: Any) -> None:
    spec.gamma = norm.weight.detach().float().numpy()
    spec.beta = norm.bias.detach().float().numpy()


def _set_layers(stack_spec: Any, layers: Any, *, decoder: bool) -> None:
    for spec, layer in zip(stack_spec.layer, layers):
        _set_linear(spec.self_attention.linear[0], layer.self_attn.qkv_proj)  # fused q, k, v (this order)
        _set_linear(spec.self_attention.linear[1], layer.self_attn.out_proj)
        _set_norm(spec.self_attention.layer_norm, layer.res_attn.norm if not decoder else layer.res_self.norm)
        if decoder:
            _set_linear(spec.attention.linear[0], layer.cross_attn.q_proj)
            _set_linear(spec.attention.linear[1], layer.cross_attn.kv_proj)  # fused k, v (this order)
            _set_linear(spec.attention.linear[2], layer.cross_attn.out_proj)
            _set_norm(spec.attention.layer_norm, layer.res_cross.norm)
        _set_linear(spec.ffn.linear_0, layer.ffn.fc1)
        _set_linear(spec.ffn.linear_1, layer.ffn.fc2)
        _set_norm(spec.ffn.layer_norm, layer.res_ffn.norm)


def build_spec(model: Any, vocabulary: list[str]) -> Any:
    """The CTranslate2 ``TransformerSpec`` of a :class:`model.Transformer` (shared embeddings, its sinusoids)."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        cfg.n_layers, cfg.n_heads, pre_norm=cfg.pre_norm, activation=common_spec.Activation.RELU)
    embed = model.embed.weight.detach().float().numpy()
    positions = model.positions.detach().float().numpy()
    for stack, layers, final in ((spec.encoder, model.encoder, model.enc_norm),
                                 (spec.decoder, model.decoder, model.dec_norm)):
        (stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings).weight = embed
        stack.scale_embeddings = True  # x · sqrt(d_model), as Transformer._embed
        stack.position_encodings.encodings = positions
        _set_layers(stack, layers, decoder=stack is spec.decoder)
        if cfg.pre_norm:
            _set_norm(stack.layer_norm, final)
    spec.decoder.projection.weight = embed
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    spec.config.add_source_eos = True
    spec.config.decoder_start_token = "<s>"
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary)
    return spec


def export(model_path: str | Path, output: str | Path, quantization: str = "float32") -> Path:
    """Write a CTranslate2 model directory for an ``averaged.pt``.

    Raises:
        PipelineError: an unknown quantization, a model CTranslate2 cannot represent, an unreadable model file.
    """
    import sentencepiece as spm
    from ctranslate2.converters.converter import Converter

    from pipeline.artifacts import model_file

    if quantization not in QUANTIZATIONS:
        raise PipelineError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    output = Path(output)
    check_output(output, model_path, default_output(model_path))
    mf = model_file.load(model_path)
    sp = spm.SentencePieceProcessor(model_proto=mf.spm)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if problems := unsupported(mf.config, pieces):
        raise PipelineError(f"{model_path}: cannot export to CTranslate2: " + "; ".join(problems))
    vocabulary = ["<blank>" if p == "<pad>" else p for p in pieces]  # <blank>: CTranslate2's padding token
    spec = build_spec(model_file.build_model(mf, model_path), vocabulary)

    class _FromSpec(Converter):
        def _load(self) -> Any:
            return spec

    with atomic_path(output, role=EXPORT_ROLE, option="--output") as tmp:  # replaces only an export it wrote
        _FromSpec().convert(str(tmp), quantization=None if quantization == "float32" else quantization)
        (tmp / SPM_NAME).write_bytes(mf.spm)
        (tmp / CONFIG_NAME).write_text(json.dumps(mf.config.to_dict(), indent=1) + "\n")
        digest.write(tmp)  # last: it records every file above
    log.info("exported %s to %s (CTranslate2, %s)", model_path, output, quantization)
    return output


@dataclass
class Ct2Translator:
    """A loaded CTranslate2 export: the translator, its SentencePiece model and the model's config."""

    translator: Any  # ctranslate2.Translator
    config: TransformerConfig
    sp: Any  # sentencepiece.SentencePieceProcessor


def _export_command(output: Path) -> str:
    return f"`nmt export --format ctranslate2 --model {AVERAGED} --output {output}`"


def check(model_dir: str | Path, *, remedy: str | None = None) -> Path:
    """``model_dir`` as a path, if it is a complete, unchanged export (its files match ``nmt_sha256.json``).

    Raises:
        PipelineError: one line naming the path, what is wrong and ``remedy`` (default: export it again).
    """
    model_dir = Path(model_dir)
    remedy = remedy or f"export it again with {_export_command(model_dir)}"
    if model_dir.exists() and not model_dir.is_dir():
        raise PipelineError(f"{model_dir}: a file, not a CTranslate2 export folder; translate an averaged.pt with "
                            f"--engine torch, or export it with `nmt export --format ctranslate2 --model {model_dir} "
                            f"--output {default_output(model_dir)}` and give that folder")
    if not model_dir.is_dir():  # advice to export onto a missing averaged.pt's path, or below a file, would fail
        blocker = file_in(model_dir)
        target = default_output(blocker or model_dir) if blocker or model_dir.suffix == ".pt" else model_dir
        raise PipelineError(f"{model_dir}: does not exist; give the folder `nmt export` wrote, or write one with "
                            f"{_export_command(target)}")
    missing = [n for n in ("model.bin", SPM_NAME, CONFIG_NAME) if not (model_dir / n).is_file()]
    if missing:
        raise PipelineError(f"{model_dir}: not a CTranslate2 export ({', '.join(missing)} missing); write one "
                            f"with {_export_command(model_dir)}")
    digest.check(model_dir, remedy=remedy)
    return model_dir


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def load(model_dir: str | Path, *, device: str = "cpu", device_index: int = 0, inter_threads: int = 1,
         intra_threads: int = 0, remedy: str | None = None) -> Ct2Translator:
    """Load a directory written by :func:`export`, after :func:`check` (``remedy``: see there).

    Raises:
        PipelineError: a missing or damaged export, or one CTranslate2 or SentencePiece cannot load (one line).
    """
    import ctranslate2
    import sentencepiece as spm

    model_dir = check(model_dir, remedy=remedy)
    remedy = remedy or f"export it again with {_export_command(model_dir)}"
    try:
        config = TransformerConfig(**json.loads((model_dir / CONFIG_NAME).read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError) as exc:
        raise PipelineError(f"{model_dir / CONFIG_NAME}: not this code's model config ({_first_line(exc)}); "
                            f"{remedy}") from None
    try:
        translator = ctranslate2.Translator(str(model_dir), device=device, device_index=device_index,
                                            inter_threads=inter_threads, intra_threads=intra_threads)
        sp = spm.SentencePieceProcessor(model_file=str(model_dir / SPM_NAME))
    except (RuntimeError, ValueError, OSError) as exc:
        raise PipelineError(f"{model_dir}: CTranslate2 or SentencePiece cannot load it ({_first_line(exc)}); "
                            f"{remedy}") from None
    return Ct2Translator(translator, config, sp)


def decode_sources(ct2: Ct2Translator, sources: Sequence[Sequence[int]], *, beam_size: int, alpha: float,
                   max_len_a: float, max_len_b: float, max_tokens: int) -> list[list[int]]:
    """Translate model sources (ids + EOS, ``[]`` for an empty sentence): per sentence the ids without BOS/EOS."""
    cfg, sp = ct2.config, ct2.sp
    groups: dict[int, list[int]] = {}
    for i, src in enumerate(sources):
        if src:
            groups.setdefault(min(max_length(len(src), max_len_a, max_len_b), cfg.max_positions), []).append(i)
    pending = []
    for limit, members in sorted(groups.items()):
        tokens = [[sp.id_to_piece(int(t)) for t in sources[i][:-1]] for i in members]  # CTranslate2 adds EOS
        pending.append((members, ct2.translator.translate_batch(
            tokens, beam_size=beam_size, length_penalty=alpha, max_decoding_length=limit,
            min_decoding_length=0, max_input_length=0, max_batch_size=max_tokens, batch_type="tokens",
            asynchronous=True)))  # min_decoding_length 0: EOS may end step 1, as in model/beam.py (default 1)
    out: list[list[int]] = [[] for _ in sources]
    for members, results in pending:
        for i, result in zip(members, results):
            out[i] = [sp.piece_to_id(p) for p in result.result().hypotheses[0]]
    return out

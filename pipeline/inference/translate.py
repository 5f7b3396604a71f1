"""``nmt translate``: one sentence per line from stdin or a file into translations, with one model file.

The input gets the training text's normalisation (:func:`pipeline.data.normalize.normalize`); empty lines
stay empty; invalid UTF-8 and NUL bytes are replaced (U+FFFD) with a warning naming the lines; a sentence longer
than the model's ``max_positions`` is truncated with a warning instead of crashing. Optionally one
sentence's cross-attention is drawn as a PNG (one heatmap per head of a decoder layer).

Heavy imports (torch, the model, matplotlib) happen inside the command so ``nmt`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from pipeline.core.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.inference.ct2 import Ct2Translator
    from pipeline.inference.decoding import Translator

log = logging.getLogger(__name__)


def read_input(stream: BinaryIO) -> tuple[list[str], list[int]]:
    """Lines of a byte stream split on ``\\n`` only; invalid UTF-8 replaced.

    Returns:
        (lines without their newline, 1-based numbers of lines that had invalid bytes).
    """
    data = stream.read()
    if not data:
        return [], []
    raw = data.split(b"\n")
    if data.endswith(b"\n"):
        raw.pop()
    lines, bad = [], []
    for number, chunk in enumerate(raw, start=1):
        try:
            lines.append(chunk.decode("utf-8"))
        except UnicodeDecodeError:
            lines.append(chunk.decode("utf-8", errors="replace"))
            bad.append(number)
    return lines, bad


def replace_nul(lines: Sequence[str]) -> tuple[list[str], list[int]]:
    """``lines`` with NUL characters replaced by U+FFFD, and the 1-based numbers of lines that had one.

    NUL is valid UTF-8 but never text: it marks binary input. Replaced, it still yields one output line.
    """
    out, numbers = list(lines), []
    for i, line in enumerate(out):
        if "\0" in line:
            out[i] = line.replace("\0", "\ufffd")
            numbers.append(i + 1)
    return out, numbers


def _which(numbers: Sequence[int], limit: int = 10) -> str:
    shown = ", ".join(str(n) for n in numbers[:limit])
    return shown + (f" and {len(numbers) - limit} more" if len(numbers) > limit else "")


def prepare_lines(translator: Translator | Ct2Translator, lines: Sequence[str]) -> tuple[list[list[int]], list[int]]:
    """Raw lines → model sources (normalised like training text, BPE, EOS, cut to ``max_positions``).

    Returns:
        (sources, ``[]`` for an empty line; 1-based numbers of truncated lines).
    """
    from pipeline.data.normalize import normalize
    from pipeline.inference.decoding import prepare_source

    sources, truncated = [], []
    for number, line in enumerate(lines, start=1):
        text = normalize(line)
        ids = translator.sp.encode(text, out_type=int) if text else []
        source, cut = prepare_source(ids, translator.config)
        sources.append(source)
        if cut:
            truncated.append(number)
    return sources, truncated


def translate_lines(translator: Translator | Ct2Translator, lines: Sequence[str], *, beam_size: int = 4,
                    alpha: float = 0.6, max_len_a: float = 1.0, max_len_b: float = 50, max_tokens: int = 8192,
                    workers: int = 1) -> tuple[list[str], list[list[int]], list[list[int]], list[int]]:
    """Translate raw lines (normalised like training text) with either engine.

    Returns:
        (translations, model sources, hypothesis ids, 1-based numbers of truncated lines).
    """
    from pipeline.inference import ct2
    from pipeline.inference.decoding import decode_sources, detokenize

    sources, truncated = prepare_lines(translator, lines)
    settings = {"beam_size": beam_size, "max_len_a": max_len_a, "max_len_b": max_len_b, "max_tokens": max_tokens}
    if isinstance(translator, ct2.Ct2Translator):
        hyps = ct2.decode_sources(translator, sources, alpha=alpha, **settings)
    else:
        hyps = decode_sources(translator, sources, alphas=[alpha], label="translate", workers=workers,
                              **settings)[float(alpha)]
    return detokenize(translator.sp, hyps), sources, hyps, truncated


def plot_cross_attention(translator: Translator, source: Sequence[int], hyp: Sequence[int], layer: int,
                         path: str | Path) -> None:
    """Heatmaps of decoder layer ``layer``'s cross-attention, one panel per head, written as a PNG.

    Rows are the target pieces the decoder predicts (the hypothesis, then ``</s>``), columns the
    source pieces (BPE pieces, then ``</s>``).

    Raises:
        PipelineError: ``layer`` out of range.
    """
    import torch
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from pipeline.core.textio import atomic_path

    cfg = translator.config
    if not -cfg.n_layers <= layer < cfg.n_layers:
        raise PipelineError(f"--attention-layer {layer}: the model has {cfg.n_layers} decoder layer(s) "
                            f"(use 0..{cfg.n_layers - 1} or -1 for the last)")
    dev = translator.device
    src = torch.tensor(list(source), dtype=torch.long, device=dev)
    tgt_in = torch.tensor([cfg.bos_id, *hyp], dtype=torch.long, device=dev)
    weights = translator.model.cross_attention(src, tgt_in, layer=layer).float().cpu()  # [H, T, S]
    src_labels = [translator.sp.id_to_piece(int(i)) for i in source]
    tgt_labels = [translator.sp.id_to_piece(int(i)) for i in hyp] + ["</s>"]
    heads = weights.shape[0]
    cols = min(heads, 4)
    rows = -(-heads // cols)
    size = (max(4.0, 0.35 * len(src_labels) + 1.5) * cols, max(3.0, 0.3 * len(tgt_labels) + 1.5) * rows)
    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    for h in range(heads):
        ax = fig.add_subplot(rows, cols, h + 1)
        image = ax.imshow(weights[h].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(src_labels)), src_labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(tgt_labels)), tgt_labels, fontsize=7)
        ax.set_title(f"layer {layer % cfg.n_layers}, head {h}", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})


def _attention_line(lines: Sequence[str], sources: Sequence[Sequence[int]], wanted: int | None) -> int:
    if wanted is not None:
        if not 1 <= wanted <= len(lines) or not sources[wanted - 1]:
            raise PipelineError(f"--attention-line {wanted}: no such non-empty input line (input has {len(lines)})")
        return wanted - 1
    for i, source in enumerate(sources):
        if source:
            return i
    raise PipelineError("--attention-png: the input has no non-empty line to draw")


def _load(args: argparse.Namespace) -> Translator | Ct2Translator:
    """The engine ``--engine`` names, with ``--workers`` searches of ``--threads`` threads each."""
    if args.engine == "ctranslate2":
        from pipeline.inference import ct2

        if args.attention_png:
            raise PipelineError("--attention-png draws the torch model's attention: use it with --engine torch")
        device = "cuda" if (args.device or "cpu").startswith("cuda") else "cpu"
        return ct2.load(args.model, device=device, inter_threads=args.workers, intra_threads=args.threads)
    import torch

    from pipeline.inference.decoding import load_translator

    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.workers > 1:
        torch.set_num_threads(1)  # parallel searches, one thread each (the layout that decodes fastest on CPU)
    return load_translator(args.model, args.device)


def run(args: argparse.Namespace) -> int:
    """Body of ``nmt translate``."""
    from pipeline.core.textio import write_lines

    if args.beam < 1 or args.max_tokens < 1 or args.workers < 1 or args.threads < 0:
        raise PipelineError("--beam, --max-tokens and --workers must be >= 1, --threads >= 0")
    translator = _load(args)
    if args.input in (None, "-"):
        lines, bad = read_input(sys.stdin.buffer)
    else:
        try:
            with open(args.input, "rb") as fh:
                lines, bad = read_input(fh)
        except OSError as exc:
            raise PipelineError(f"{args.input}: cannot be read ({exc.strerror})") from None
    if bad:
        log.warning("%d input line(s) had invalid UTF-8, replaced by U+FFFD: line(s) %s", len(bad), _which(bad))
    lines, nul = replace_nul(lines)
    if nul:
        log.warning("%d input line(s) had NUL bytes (binary input?), replaced by U+FFFD: line(s) %s", len(nul),
                    _which(nul))
    out, sources, hyps, truncated = translate_lines(
        translator, lines, beam_size=args.beam, alpha=args.alpha, max_len_a=args.max_len_a,
        max_len_b=args.max_len_b, max_tokens=args.max_tokens, workers=args.workers)
    if truncated:
        log.warning("%d line(s) longer than the model's max_positions (%d tokens with EOS) were truncated: "
                    "line(s) %s", len(truncated), translator.config.max_positions, _which(truncated))
    if args.output in (None, "-"):
        sys.stdout.buffer.write("".join(line + "\n" for line in out).encode("utf-8"))
        sys.stdout.buffer.flush()
    else:
        write_lines(args.output, out)
    if args.attention_png:
        i = _attention_line(lines, sources, args.attention_line)
        plot_cross_attention(translator, sources[i], hyps[i], args.attention_layer, args.attention_png)
        log.info("wrote cross-attention of line %d to %s", i + 1, args.attention_png)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``translate`` on the ``nmt`` sub-command parser."""
    p = sub.add_parser("translate", help="translate lines (stdin or --input) with an averaged.pt model or its "
                                         "CTranslate2 export")
    p.add_argument("--model", required=True, help="an averaged.pt written by the average stage (--engine torch) or "
                                                  "a directory written by `nmt export` (--engine ctranslate2)")
    p.add_argument("--engine", choices=("torch", "ctranslate2"), default="torch",
                   help="this project's beam search (default) or CTranslate2's on an export")
    p.add_argument("--input", help="input file, one sentence per line (default: stdin)")
    p.add_argument("--output", help="output file, written atomically (default: stdout)")
    p.add_argument("--beam", type=int, default=4, help="beam size (default 4)")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty alpha (default 0.6)")
    p.add_argument("--max-len-a", type=float, default=1.0, help="max output length = a * source length + b")
    p.add_argument("--max-len-b", type=float, default=50, help="see --max-len-a (default 50)")
    p.add_argument("--max-tokens", type=int, default=8192, help="batch budget in padded source tokens")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--workers", type=int, default=1, help="searches run at once (CPU: give each one thread)")
    p.add_argument("--threads", type=int, default=0,
                   help="threads per search (default: 1 with --workers > 1, else the library's default)")
    p.add_argument("--attention-png", help="draw one sentence's cross-attention into this PNG")
    p.add_argument("--attention-layer", type=int, default=-1, help="decoder layer to draw (default: last)")
    p.add_argument("--attention-line", type=int, help="1-based input line to draw (default: first non-empty)")
    p.set_defaults(func=run)

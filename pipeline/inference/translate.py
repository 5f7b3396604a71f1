"""``nmt translate``: one sentence per line from stdin or a file into translations, with one model file; standard
input is read as fairseq-interactive reads it, and with ``--engine ctranslate2`` torch is never imported."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.config import BEAM_RANGE, BEAM_RULES, MAX_BEAM_SIZE, beam_size_problem
from pipeline.core.console import arg_type
from pipeline.core.errors import PipelineError
from pipeline.inference.common import check_cuda, detokenize, parse_device, prepare_source
from pipeline.inference.lines import read_input, split_lines, stream_chunks  # noqa: F401 - split_lines: tests
from pipeline.inference.attention import (AttentionPick, check_attention_layer, check_attention_line,
                                          check_attention_options, plot_cross_attention)

if TYPE_CHECKING:
    from pipeline.inference.ct2 import Ct2Translator
    from pipeline.inference.decoding import Translator

log = logging.getLogger(__name__)


def decode_lines(raw: Sequence[bytes], first: int = 1) -> tuple[list[str], list[int]]:
    """Byte lines as text, invalid UTF-8 replaced by U+FFFD, and the numbers (``raw[0]`` is ``first``) of those."""
    lines, bad = [], []
    for number, chunk in enumerate(raw, start=first):
        try:
            lines.append(chunk.decode("utf-8"))
        except UnicodeDecodeError:
            lines.append(chunk.decode("utf-8", errors="replace"))
            bad.append(number)
    return lines, bad


def _which(numbers: Sequence[int], limit: int = 10) -> str:
    shown = ", ".join(str(n) for n in numbers[:limit])
    return shown + (f" and {len(numbers) - limit} more" if len(numbers) > limit else "")


def prepare_lines(translator: Translator | Ct2Translator, lines: Sequence[str]) -> tuple[list[list[int]], list[int]]:
    """Raw lines → (model sources as for training text, cut to ``max_positions``; 1-based truncated line numbers)."""
    from pipeline.data.normalize import normalize

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
                    alpha: float = 0.6, max_len_a: float = 1.0, max_len_b: float = 50,
                    max_tokens: int = 8192, beam_rule: str = "fairseq",
                    ) -> tuple[list[str], list[list[int]], list[list[int]], list[int]]:
    """Translate raw lines with either engine: (translations, sources, hypothesis ids, truncated line numbers).

    ``beam_rule`` (``fairseq`` or ``t2t``: ``model/beam_rules.py``) is the torch engine's; CTranslate2 searches by
    its own rule.
    """
    from pipeline.inference import ct2

    sources, truncated = prepare_lines(translator, lines)
    settings = {"beam_size": beam_size, "max_len_a": max_len_a, "max_len_b": max_len_b, "max_tokens": max_tokens}
    if isinstance(translator, ct2.Ct2Translator):
        hyps = ct2.decode_sources(translator, sources, alpha=alpha, **settings)
    else:
        from pipeline.inference.decoding import decode_sources

        hyps = decode_sources(translator, sources, alphas=[alpha], label="translate", rule=beam_rule,
                              **settings)[float(alpha)]
    return detokenize(translator.sp, hyps), sources, hyps, truncated


def check_beam(beam: int, vocab_size: int = 0, option: str = "--beam") -> None:
    """Refuse, naming ``option``, a beam outside 1 .. MAX_BEAM_SIZE or wider than ``vocab_size`` (0: not known)."""
    if problem := beam_size_problem(beam, vocab_size):
        raise PipelineError(f"{option} {beam!r:.40}: {problem}")


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``least``."""
    return arg_type(int, lambda value: value >= least, f"an integer >= {least}")


_finite_float = arg_type(float, math.isfinite, "a finite number")
#: A beam size within the project's bounds (the model's vocabulary is checked on load).
_beam = arg_type(int, lambda beam: beam_size_problem(beam) is None, BEAM_RANGE)


def _check_args(args: argparse.Namespace) -> None:
    """The option combinations that need no model and no input, each refused in one line (single options are
    refused by their argparse ``type``)."""
    if args.beam_rule is not None and args.engine == "ctranslate2":
        raise PipelineError(f"--beam-rule {args.beam_rule}: chooses this project's beam search rule; use it with "
                            "--engine torch (CTranslate2 searches by its own rule)")
    if args.workers is not None and args.engine != "ctranslate2":
        raise PipelineError(f"--workers {args.workers!r:.40}: sets how many translations CTranslate2 runs at once; "
                            "use it with --engine ctranslate2 (the torch engine runs one search at a time: "
                            "--threads sets its threads)")
    check_attention_options(args.attention_png, args.attention_layer, args.attention_line, args.engine)


def _load(args: argparse.Namespace) -> Translator | Ct2Translator:
    """The engine ``--engine`` names, on the ``--device`` checked first."""
    if args.engine == "ctranslate2":
        import ctranslate2

        from pipeline.inference import ct2

        kind, index = ("cpu", None) if args.device is None else parse_device(args.device)
        if kind == "cuda":
            check_cuda(args.device, index, ctranslate2.get_cuda_device_count(), library="ctranslate2",
                       probe="ctranslate2.get_cuda_device_count() is 0")
        return ct2.load(args.model, device=kind, device_index=index or 0, inter_threads=args.workers or 1,
                        intra_threads=args.threads)
    import torch

    from pipeline.inference.ct2 import check_averaged
    from pipeline.inference.decoding import load_translator, resolve_device

    device = resolve_device(args.device)
    check_averaged(args.model)  # missing, or a folder: one line naming --model
    if args.threads:
        torch.set_num_threads(args.threads)
    return load_translator(args.model, device)


def translate_chunks(translator: Translator | Ct2Translator, chunks: Iterable[Sequence[bytes]],
                     emit: Callable[[list[str]], Any], *, pick: AttentionPick | None = None, **settings: Any) -> int:
    """Translate byte-line chunks in order, handing each chunk's translations to ``emit`` before reading on."""
    first = 1
    for raw in chunks:
        lines, bad = decode_lines(raw, first)
        if bad:
            log.warning("%d input line(s) had invalid UTF-8, replaced by U+FFFD: line(s) %s", len(bad), _which(bad))
        nul = [first + i for i, line in enumerate(lines) if "\0" in line]  # valid UTF-8, but never text
        lines = [line.replace("\0", "\ufffd") for line in lines]
        if nul:
            log.warning("%d input line(s) had NUL bytes (binary input?), replaced by U+FFFD: line(s) %s",
                        len(nul), _which(nul))
        out, sources, hyps, truncated = translate_lines(translator, lines, **settings)
        if truncated:
            log.warning("%d line(s) longer than the model's max_positions (%d tokens with EOS) were truncated: "
                        "line(s) %s", len(truncated), translator.config.max_positions,
                        _which([first - 1 + n for n in truncated]))
        emit(out)
        if pick is not None:
            pick.see(first, sources, hyps)
        first += len(raw)
    return first - 1


def _write_stdout(lines: Sequence[str]) -> None:
    sys.stdout.buffer.write("".join(line + "\n" for line in lines).encode("utf-8"))
    sys.stdout.buffer.flush()


def run(args: argparse.Namespace) -> int:
    """Body of ``nmt translate``."""
    _check_args(args)
    raw = None
    if args.input not in (None, "-"):
        raw = read_input(args.input)
        if args.attention_png:
            check_attention_line(raw, args.attention_line, args.input)
    translator = _load(args)
    check_beam(args.beam, translator.config.vocab_size)
    _translate(args, translator, raw)
    return 0


def _translate(args: argparse.Namespace, translator: Translator | Ct2Translator, raw: list[bytes] | None) -> None:
    """Translate the input ``raw`` (or stdin when None) to the output, then draw the attention figure if asked."""
    from pipeline.core.owned import refuse_foreign, write_lines, writes_into

    to_file = args.output not in (None, "-")
    for path in (args.output if to_file else None, args.attention_png):
        if path is not None and not writes_into(path):  # a FIFO, a terminal or /dev/stdout is written into
            refuse_foreign(Path(path), None)  # a folder or a link is refused before the work, not after it
    pick = None
    if args.attention_png:
        check_attention_layer(args.attention_layer, translator.config.n_layers)
        pick = AttentionPick(args.attention_line)
    outputs: list[str] = []
    total = translate_chunks(
        translator, [raw] if raw is not None else stream_chunks(sys.stdin.fileno()),
        outputs.extend if to_file else _write_stdout, pick=pick, beam_size=args.beam, alpha=args.alpha,
        max_len_a=args.max_len_a, max_len_b=args.max_len_b, max_tokens=args.max_tokens,
        beam_rule=args.beam_rule or "fairseq")
    picked = pick.result(total) if pick is not None else None  # refused before --output is written
    if to_file:
        write_lines(args.output, outputs, option="--output")
    if picked is not None:
        number, source, hyp = picked
        plot_cross_attention(translator, source, hyp, args.attention_layer, args.attention_png)
        log.info("wrote cross-attention of line %d to %s", number, args.attention_png)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``translate`` on the ``nmt`` sub-command parser."""
    p = sub.add_parser("translate", help="translate lines (stdin or --input) with an averaged.pt model or its "
                                         "CTranslate2 export")
    p.add_argument("--model", required=True, help="an averaged.pt written by the average stage (--engine torch) or "
                                                  "a folder written by nmt export (--engine ctranslate2)")
    p.add_argument("--engine", choices=("torch", "ctranslate2"), default="torch",
                   help="this project's beam search (default) or CTranslate2's on an export")
    p.add_argument("--input", help="input file, one sentence per line (default: stdin, translated as lines arrive)")
    p.add_argument("--output", help="output file, written atomically at the end (a FIFO, terminal or /dev/stdout: "
                                    "written into; default: stdout, written as lines are translated)")
    p.add_argument("--beam", type=_beam, default=4,
                   help=f"beam size, 1 to {MAX_BEAM_SIZE} and at most the vocabulary size (default 4)")
    p.add_argument("--alpha", type=_finite_float, default=0.6, help="length penalty alpha (default 0.6)")
    p.add_argument("--beam-rule", choices=BEAM_RULES,
                   help="--engine torch: fairseq's rule (default) or tensor2tensor's, the paper's code "
                        "(model/beam_rules.py)")
    p.add_argument("--max-len-a", type=_finite_float, default=1.0, help="max output length = a * source length + b")
    p.add_argument("--max-len-b", type=_finite_float, default=50, help="see --max-len-a (default 50)")
    p.add_argument("--max-tokens", type=_at_least(1), default=8192,
                   help="batch budget in padded source tokens: what one search holds (default 8192)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if torch sees one, else cpu; "
                                    "--engine ctranslate2: cpu)")
    p.add_argument("--workers", type=_at_least(1),
                   help="--engine ctranslate2 only: translations run at once (CTranslate2's inter_threads, default 1)")
    p.add_argument("--threads", type=_at_least(0), default=0,
                   help="threads per translation (CTranslate2's intra_threads) or of the torch engine "
                        "(default: the library's)")
    p.add_argument("--attention-png", help="draw one sentence's cross-attention into this PNG")
    p.add_argument("--attention-layer", type=int, help="decoder layer to draw, 1..number of layers "
                                                       "(default: the last)")
    p.add_argument("--attention-line", type=int, help="input line to draw, from 1 (default: first non-empty)")
    p.set_defaults(func=run)

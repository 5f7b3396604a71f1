"""Benchmark decoding: this project's beam search (batched, and one sentence at a time) against CTranslate2 (fp32
and int8) on the same weights; ``process``: the whole ``nmt translate --engine ctranslate2`` process against a plain
CTranslate2 script. Rows are timed in rounds, the fastest of ``--repeats`` counting (:func:`in_rounds`).

Usage: ``python benchmarks/decode.py --model NAME=PATH [--model ...]``, ``... process --export DIR``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, header, md_table, setup_logging, write_json  # noqa: E402

DATA = Path(os.environ.get("NMT_DATA_MIRROR") or REPO.parent / "shared" / "data")
log = logging.getLogger("bench.decode")
BEAM, ALPHA, MAX_LEN_A, MAX_LEN_B = 4, 0.6, 1.0, 50
REPEATS = 1  # timed runs per row, the fastest counts (``--repeats``)
#: The sets a row is measured on (``--sets``) and their sentences; ``multi30k-val`` gives the models' valid BLEU.
SETS = {"multi30k-test": 1000, "newstest2014": 300}
SINGLE_LIMIT = 200  # sentences of the one-at-a-time rows
#: ``max_tokens`` of the CTranslate2 rows: its int8 decoding ran fastest with small batches (256-512), fp32 with any.
CT2_MAX_TOKENS = (256, 512, 4096)
TORCH_MAX_TOKENS = (1024, 4096, 16384)  # of this project's batched rows (what one search holds)
Hyps = list[list[int]]


def read_set(data: Path, name: str, limit: int | None) -> tuple[list[str], list[str]]:
    """(sources, references) of ``multi30k-test``, ``multi30k-val`` or ``newstest2014``, first ``limit`` lines."""
    if name == "newstest2014":
        src, ref = ((data / "wmt14" / "test-full-txt" / f"newstest2014.{lang}").read_text(encoding="utf-8")
                    .splitlines() for lang in ("en", "de"))
    else:
        stem = {"multi30k-test": "test_2016_flickr", "multi30k-val": "val"}[name]
        src, ref = (gzip.open(data / "multi30k" / "data" / "task1" / "raw" / f"{stem}.{lang}.gz", "rt",
                              encoding="utf-8").read().splitlines() for lang in ("en", "de"))
    return src[:limit], ref[:limit]


def bleu(translator: Any, hyps: Hyps, refs: list[str]) -> float:
    """sacreBLEU of the detokenised ``hyps`` against the first ``len(hyps)`` references."""
    import sacrebleu

    from pipeline.inference.common import detokenize

    return round(sacrebleu.corpus_bleu(detokenize(translator.sp, hyps), [refs[:len(hyps)]]).score, 2)


def torch_row(translator: Any, sources: Hyps, *, alpha: float, max_tokens: int, threads: int
              ) -> Callable[[], tuple[float, Hyps]]:
    """One timed decode of this project's search on ``threads`` threads: (seconds, hypotheses)."""
    import torch

    from pipeline.inference.decoding import decode_sources

    def run() -> tuple[float, Hyps]:
        torch.set_num_threads(threads)
        return timed(lambda: decode_sources(translator, sources, beam_size=BEAM, alphas=[alpha], max_len_a=MAX_LEN_A,
                                            max_len_b=MAX_LEN_B, max_tokens=max_tokens)[alpha])
    return run


def ct2_row(export_dir: Path, sources: Hyps, *, alpha: float, inter: int, intra: int, max_tokens: int
            ) -> Callable[[], tuple[float, Hyps]]:
    """One timed CTranslate2 decode (the engine loaded first, not timed): (seconds, hypotheses)."""
    from pipeline.inference import ct2

    def run() -> tuple[float, Hyps]:
        engine = ct2.load(export_dir, inter_threads=inter, intra_threads=intra)
        return timed(lambda: ct2.decode_sources(engine, sources, beam_size=BEAM, alpha=alpha, max_len_a=MAX_LEN_A,
                                                max_len_b=MAX_LEN_B, max_tokens=max_tokens))
    return run


def timed(decode: Callable[[], Hyps]) -> tuple[float, Hyps]:
    start = time.perf_counter()
    hyps = decode()
    return time.perf_counter() - start, hyps


@dataclass
class Row:
    """A table row: what it measures (``meta``), its timed decode, and the fastest run so far."""

    meta: dict[str, str | int]
    run: Callable[[], tuple[float, Hyps]]
    seconds: float = math.inf
    hyps: Hyps = field(default_factory=list)

    def result(self, translator: Any, base: Hyps, refs: list[str]) -> dict[str, Any]:
        """The row's JSON: sentences/s, generated tokens/s, mean length, share equal to ``base``, BLEU."""
        n, tokens, s = len(self.hyps), sum(len(h) for h in self.hyps), self.seconds
        same = round(sum(a == b for a, b in zip(self.hyps, base)) / n, 4)
        return {**self.meta, "sentences": n, "seconds": round(s, 2), "sent_per_s": round(n / s, 1),
                "tok_per_s": round(tokens / s, 1), "mean_len": round(tokens / n, 2), "same_as_batched": same,
                "bleu": bleu(translator, self.hyps, refs)}


def in_rounds(rows: list[Row]) -> None:
    """Run every row :data:`REPEATS` times round-robin, keeping each row's fastest run (a slow spell of a shared
    machine then falls on every row alike)."""
    for _ in range(REPEATS):
        for r in rows:
            seconds, hyps = r.run()
            if seconds < r.seconds:
                r.seconds, r.hyps = seconds, hyps


def plan_rows(translator: Any, exports: dict[str, Path], sources: Hyps, t: int, single_limit: int) -> list[Row]:
    """Every timed row at ``t`` threads; the first is this project's batched search (the rows' ``base``)."""
    from pipeline.inference.decoding import plan_searches

    rows = []
    for max_tokens in TORCH_MAX_TOKENS:
        plan = plan_searches(translator, sources, beam_size=BEAM, max_len_a=MAX_LEN_A, max_len_b=MAX_LEN_B,
                             max_tokens=max_tokens)
        rows.append(Row({"engine": "torch batched", "layout": f"1x{t}", "threads": t, "max_tokens": max_tokens,
                         "searches": len(plan), "largest_search": max((len(job[0]) for job in plan), default=0)},
                        torch_row(translator, sources, alpha=ALPHA, max_tokens=max_tokens, threads=t)))
    rows.append(Row({"engine": "torch one at a time", "layout": f"1x{t}", "threads": t},
                    torch_row(translator, sources[:single_limit], alpha=ALPHA, max_tokens=1, threads=t)))
    rows += [Row({"engine": f"ctranslate2 {quant}", "layout": f"{inter}x{intra}", "threads": t, "max_tokens": tokens},
                 ct2_row(export_dir, sources, alpha=ALPHA, inter=inter, intra=intra, max_tokens=tokens))
             for quant, export_dir in exports.items() for inter, intra in dict.fromkeys(((t, 1), (1, t)))
             for tokens in CT2_MAX_TOKENS]
    return rows


def measure_set(translator: Any, exports: dict[str, Path], srcs: list[str], refs: list[str], *, threads: list[int],
                single_limit: int) -> list[dict[str, Any]]:
    """Every row for one model and one set; then CTranslate2 fp32 at α 0 beside ours at α 0 (its length penalty
    differs from GNMT's)."""
    from pipeline.inference.translate import prepare_lines

    sources, out = prepare_lines(translator, srcs)[0], []
    for t in threads:
        rows = plan_rows(translator, exports, sources, t, min(single_limit, len(sources)))
        in_rounds(rows)
        out += [r.result(translator, rows[0].hyps, refs) for r in rows]
        _, torch0 = torch_row(translator, sources, alpha=0.0, max_tokens=4096, threads=t)()
        ct0 = Row({"engine": "ctranslate2 float32, alpha 0", "layout": f"1x{t}", "threads": t, "max_tokens": 4096},
                  ct2_row(exports["float32"], sources, alpha=0.0, inter=1, intra=t, max_tokens=4096))
        in_rounds([ct0])
        out.append(ct0.result(translator, torch0, refs))
    return out


def measure_model(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One model's valid BLEU and every set's rows (CTranslate2 exports made in a temporary folder)."""
    import torch

    from pipeline.inference import ct2
    from pipeline.inference.decoding import load_translator
    from pipeline.inference.translate import prepare_lines

    torch.set_num_threads(1)
    translator = load_translator(path, "cpu")
    n_params = sum(p.numel() for p in translator.model.parameters())
    val_src, val_ref = read_set(args.data, "multi30k-val", None)
    _, val_hyps = torch_row(translator, prepare_lines(translator, val_src)[0], alpha=ALPHA, max_tokens=4096,
                            threads=1)()
    out: dict[str, Any] = {"path": str(path), "parameters": n_params, "config": translator.config.to_dict(),
                           "valid_bleu": bleu(translator, val_hyps, val_ref), "sets": {}}
    log.info("%s: %d parameters, valid BLEU %.2f", path, n_params, out["valid_bleu"])
    with tempfile.TemporaryDirectory() as tmp:
        exports = {q: ct2.export(path, Path(tmp) / q, q) for q in ("float32", "int8")}
        for name in args.sets.split(","):
            out["sets"][name] = measure_set(translator, exports, *read_set(args.data, name, SETS.get(name, 1000)),
                                            threads=[int(t) for t in args.threads.split(",")],
                                            single_limit=SINGLE_LIMIT)
    return out


def table(result: dict[str, Any]) -> str:
    rows = [(f"{model} (valid {m['valid_bleu']})", f"{name} ({r['sentences']})", r["threads"], r["engine"],
             r["layout"], r.get("max_tokens", ""),
             f"{r['searches']} ({r['largest_search']})" if "searches" in r else "", r["sent_per_s"], r["tok_per_s"],
             r["mean_len"], f"{100 * r['same_as_batched']:.1f}%", r["bleu"])
            for model, m in result["models"].items() for name, set_rows in m["sets"].items() for r in set_rows]
    return md_table(("model", "set", "threads", "engine", "layout", "max_tokens", "searches (largest)", "sent/s",
                     "tok/s", "mean len", "same as batched", "BLEU"), rows)


#: A plain CTranslate2 script at ``nmt translate``'s defaults (argv: an ``nmt export`` folder, input, output, the
#: model's ``max_positions``, past which CTranslate2 has no position encoding).
PLAIN_CT2 = """\
import sys

import ctranslate2
import sentencepiece as spm

model_dir, src_path, out_path, longest = sys.argv[1:5]
sp = spm.SentencePieceProcessor(model_file=model_dir + "/spm.model")
translator = ctranslate2.Translator(model_dir, device="cpu")
with open(src_path, encoding="utf-8") as f:
    tokens = [sp.encode(line, out_type=str) for line in f.read().splitlines()]
results = translator.translate_batch(tokens, beam_size=4, length_penalty=0.6, max_batch_size=8192,
                                     batch_type="tokens", max_decoding_length=int(longest))
with open(out_path, "w", encoding="utf-8") as f:
    f.writelines(sp.decode(r.hypotheses[0]) + "\\n" for r in results)
"""
NMT_CT2, PLAIN = "nmt translate --engine ctranslate2", "plain CTranslate2 script"


def imports_torch(command: list[str]) -> bool:
    """Whether the Python process ``command`` (``[python, args...]``) imports torch (``python -X importtime``)."""
    proc = subprocess.run([command[0], "-X", "importtime", *command[1:]], cwd=REPO, capture_output=True, text=True,
                          check=True)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in proc.stderr.splitlines())


def measure_processes(export: Path, lines: list[str], repeats: int) -> dict[str, Any]:
    """Wall seconds of whole processes translating ``lines``: ``nmt translate`` (CTranslate2) and :data:`PLAIN_CT2`."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        src, script = folder / "in.en", folder / "plain_ct2.py"
        src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        script.write_text(PLAIN_CT2, encoding="utf-8")
        longest = json.loads((export / "nmt_model.json").read_text(encoding="utf-8"))["max_positions"]
        commands = {
            NMT_CT2: [sys.executable, "-m", "pipeline.cli", "translate", "--engine", "ctranslate2", "--model",
                      str(export), "--input", str(src), "--output", str(folder / "nmt.de")],
            PLAIN: [sys.executable, str(script), str(export), str(src), str(folder / "plain.de"), str(longest)],
        }
        best = dict.fromkeys(commands, math.inf)
        for _ in range(repeats):
            for name, command in commands.items():
                start = time.perf_counter()
                subprocess.run(command, cwd=REPO, capture_output=True, check=True)
                best[name] = min(best[name], time.perf_counter() - start)
        return {"sentences": len(lines), "seconds": {k: round(v, 2) for k, v in best.items()},
                "ratio": round(best[NMT_CT2] / best[PLAIN], 2), "nmt_imports_torch": imports_torch(commands[NMT_CT2])}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    process = argv[:1] == ["process"]
    p = argparse.ArgumentParser(prog="decode.py process" if process else None,
                                description=(measure_processes.__doc__ if process else __doc__).splitlines()[0])
    if process:
        p.add_argument("--export", type=Path, required=True, help="a folder `nmt export` wrote")
    else:
        p.add_argument("--model", action="append", required=True, help="NAME=path/to/averaged.pt (repeatable)")
        p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
        p.add_argument("--threads", default="1,2")
        p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "decode.json")
    p.add_argument("--data", type=Path, default=DATA, help="the shared data folder (multi30k/, wmt14/)")
    p.add_argument("--repeats", type=int, default=3 if process else 1, help="runs (in rounds), the fastest counts")
    args = p.parse_args(argv[1:] if process else argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    unknown = [] if process else sorted(set(args.sets.split(",")) - set(SETS) - {"multi30k-val"})
    if unknown:
        p.error(f"--sets {args.sets}: unknown set(s) {', '.join(unknown)}; use {', '.join(SETS)}")
    setup_logging()
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    if process:
        result = measure_processes(args.export, read_set(args.data, "multi30k-test", None)[0], args.repeats)
        print(json.dumps({**header(argv), "set": "multi30k-test", **result}, indent=1))
        return 0
    global REPEATS
    REPEATS = args.repeats
    result = {**header(argv), "beam": BEAM, "alpha": ALPHA, "repeats": REPEATS,
              "models": {name: measure_model(Path(path), args) for name, _, path in
                         (spec.partition("=") for spec in args.model)}}
    print(table(result))
    write_json(args.out, result)
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

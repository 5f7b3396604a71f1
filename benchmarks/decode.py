"""Benchmark decoding: this project's beam search (batched, and one sentence at a time) against CTranslate2
(fp32 and int8) on the same weights, beam 4, at 1 and 2 threads; and (``process``) the whole
``nmt translate --engine ctranslate2`` process against a plain CTranslate2 script on the same export.

For every model (``--model NAME=averaged.pt``) and source set (Multi30k test_2016_flickr, newstest2014),
each row times a decode of the same sources (the fastest of ``--repeats``, run in rounds that each time every
row once, so a slow spell of the machine falls on all rows alike) and reports sentences/s,
generated tokens/s (output pieces, EOS excluded), the mean output length, the share of sentences whose
output equals this project's batched output at the same α, and sacreBLEU against the reference. A model's
valid BLEU (Multi30k val, this project's batched search) is reported beside it: random weights decode to
max_len and would not count. This project's batched rows also give their searches (how many, and the most
sentences in one) at each batch budget. Thread layouts: this project runs one search at a time with T torch
threads; CTranslate2 runs ``inter_threads`` × ``intra_threads``, each at the batch budgets
:data:`CT2_MAX_TOKENS`; the table gives each.
The CTranslate2 export is made by ``pipeline.inference.ct2.export`` (the ``nmt export`` code).

``process`` times whole processes, start-up included (the fastest of ``--repeats``): ``nmt translate --engine
ctranslate2`` and :data:`PLAIN_CT2`, a plain CTranslate2 script, each translating the same file with the same
export at beam 4 and α 0.6.

Usage:
    python benchmarks/decode.py --model demo=runs/demo/model/averaged.pt --model d256=/path/averaged.pt
    python benchmarks/decode.py --model demo=... --quick     # 100 sentences per set, 1 thread layout
    python benchmarks/decode.py --model ... --repeats 2      # each row the faster of two runs (a noisy machine)
    python benchmarks/decode.py process --export runs/demo/ct2 --repeats 3   # whole processes, Multi30k test
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = Path(os.environ.get("NMT_DATA_MIRROR") or REPO.parent / "shared" / "data")
log = logging.getLogger("bench.decode")
BEAM, ALPHA, MAX_LEN_A, MAX_LEN_B = 4, 0.6, 1.0, 50
#: Timed runs per row; the fastest counts (set from ``--repeats``).
REPEATS = 1


#: The sets a row is measured on (``--sets``); ``multi30k-val`` is read for the models' valid BLEU.
SETS = ("multi30k-test", "newstest2014")


def read_set(data: Path, name: str, limit: int | None) -> tuple[list[str], list[str]]:
    """(sources, references) of ``multi30k-test``, ``multi30k-val`` or ``newstest2014``, first ``limit`` lines."""
    if name == "newstest2014":
        folder = data / "wmt14" / "test-full-txt"
        src, ref = ((folder / f"newstest2014.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "de"))
    else:
        stem = {"multi30k-test": "test_2016_flickr", "multi30k-val": "val"}[name]
        folder = data / "multi30k" / "data" / "task1" / "raw"
        src, ref = (gzip.open(folder / f"{stem}.{lang}.gz", "rt", encoding="utf-8").read().splitlines()
                    for lang in ("en", "de"))
    return src[:limit], ref[:limit]


def bleu(hyps: list[str], refs: list[str]) -> float:
    import sacrebleu

    return round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def torch_row(translator: Any, sources: list[list[int]], *, alpha: float, max_tokens: int,
              threads: int) -> Callable[[], tuple[float, list[list[int]]]]:
    """One timed decode of this project's search (``decode_sources``) on ``threads`` threads: (seconds, hypotheses)."""
    import torch

    from pipeline.inference.decoding import decode_sources

    def run() -> tuple[float, list[list[int]]]:
        torch.set_num_threads(threads)
        return timed(lambda: decode_sources(translator, sources, beam_size=BEAM, alphas=[alpha], max_len_a=MAX_LEN_A,
                                            max_len_b=MAX_LEN_B, max_tokens=max_tokens)[alpha])
    return run


def ct2_row(export_dir: Path, sources: list[list[int]], *, alpha: float, inter: int, intra: int, max_tokens: int
            ) -> Callable[[], tuple[float, list[list[int]]]]:
    """One timed CTranslate2 decode (the engine loaded first, not timed): (seconds, hypotheses)."""
    from pipeline.inference import ct2

    def run() -> tuple[float, list[list[int]]]:
        engine = ct2.load(export_dir, inter_threads=inter, intra_threads=intra)
        return timed(lambda: ct2.decode_sources(engine, sources, beam_size=BEAM, alpha=alpha, max_len_a=MAX_LEN_A,
                                                max_len_b=MAX_LEN_B, max_tokens=max_tokens))
    return run


def timed(decode: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    hyps = decode()
    return time.perf_counter() - start, hyps


@dataclass
class Row:
    """A table row: what it measures (``meta``), its timed decode, and the fastest run so far."""

    meta: dict[str, Any]
    run: Callable[[], tuple[float, list[list[int]]]]
    seconds: float = math.inf
    hyps: list[list[int]] = field(default_factory=list)


def in_rounds(rows: list[Row]) -> None:
    """Run every row :data:`REPEATS` times, round-robin (each round runs every row once), and keep each row's
    fastest run: a slow spell of a shared machine then falls on every row alike instead of on the rows that
    happened to be running, so ratios between rows of the same run hold."""
    for _ in range(REPEATS):
        for r in rows:
            seconds, hyps = r.run()
            if seconds < r.seconds:
                r.seconds, r.hyps = seconds, hyps


def result_row(r: Row, base: list[list[int]] | None, text: Callable[[list[list[int]]], list[str]],
               refs: list[str]) -> dict[str, Any]:
    """A row's JSON: sentences/s, generated tokens/s, mean length, share equal to ``base``, BLEU."""
    hyps = r.hyps
    n, tokens = len(hyps), sum(len(h) for h in hyps)
    same = None if base is None else round(sum(a == b for a, b in zip(hyps, base)) / n, 4)
    return {**r.meta, "sentences": n, "seconds": round(r.seconds, 2), "sent_per_s": round(n / r.seconds, 1),
            "tok_per_s": round(tokens / r.seconds, 1), "mean_len": round(tokens / n, 2), "same_as_batched": same,
            "bleu": bleu(text(hyps), refs[:n])}


#: ``max_tokens`` of the CTranslate2 rows: its int8 decoding ran fastest with small batches (256-512), fp32 with any.
CT2_MAX_TOKENS = (256, 512, 4096)
#: ``max_tokens`` of this project's batched rows (what one search holds).
TORCH_MAX_TOKENS = (1024, 4096, 16384)


def plan_rows(translator: Any, exports: dict[str, Path], sources: list[list[int]], t: int,
              single_limit: int) -> list[Row]:
    """Every timed row at ``t`` threads; the first is this project's batched search (the rows' ``base``)."""
    from pipeline.inference.decoding import plan_searches

    rows = []
    for max_tokens in TORCH_MAX_TOKENS:
        plan = plan_searches(translator, sources, beam_size=BEAM, max_len_a=MAX_LEN_A, max_len_b=MAX_LEN_B,
                             max_tokens=max_tokens)
        rows.append(Row({"engine": "torch batched", "layout": f"1x{t}", "threads": t,
                         "max_tokens": max_tokens, "searches": len(plan),
                         "largest_search": max((len(job[0]) for job in plan), default=0)},
                        torch_row(translator, sources, alpha=ALPHA, max_tokens=max_tokens, threads=t)))
    rows.append(Row({"engine": "torch one at a time", "layout": f"1x{t}", "threads": t},
                    torch_row(translator, sources[:single_limit], alpha=ALPHA, max_tokens=1, threads=t)))
    for quant, export_dir in exports.items():
        for inter, intra in ((t, 1), (1, t)) if t > 1 else ((1, 1),):
            for max_tokens in CT2_MAX_TOKENS:
                rows.append(Row({"engine": f"ctranslate2 {quant}", "layout": f"{inter}x{intra}", "threads": t,
                                 "max_tokens": max_tokens},
                                ct2_row(export_dir, sources, alpha=ALPHA, inter=inter, intra=intra,
                                        max_tokens=max_tokens)))
    return rows


def measure_set(translator: Any, exports: dict[str, Path], srcs: list[str], refs: list[str], *, threads: list[int],
                single_limit: int) -> list[dict[str, Any]]:
    """Every row for one model and one source set, each thread count's rows timed in rounds."""
    from pipeline.inference.common import detokenize

    sources = encode_all(translator, srcs)

    def text(hyps: list[list[int]]) -> list[str]:
        return detokenize(translator.sp, hyps)

    out = []
    for t in threads:
        rows = plan_rows(translator, exports, sources, t, min(single_limit, len(sources)))
        in_rounds(rows)
        base = rows[0].hyps
        out += [result_row(r, base, text, refs) for r in rows]
        # CTranslate2's length penalty differs from GNMT's; at α 0 both searches should agree
        _, torch0 = torch_row(translator, sources, alpha=0.0, max_tokens=4096, threads=t)()
        ct0 = Row({"engine": "ctranslate2 float32, alpha 0", "layout": f"1x{t}", "threads": t, "max_tokens": 4096},
                  ct2_row(exports["float32"], sources, alpha=0.0, inter=1, intra=t, max_tokens=4096))
        in_rounds([ct0])
        out.append(result_row(ct0, torch0, text, refs))
    return out


#: A plain CTranslate2 script on an ``nmt export`` folder (argv: the folder, an input file, an output file, the
#: longest output: the model's ``max_positions``, past which CTranslate2 has no position encoding): what ``process``
#: sets ``nmt translate --engine ctranslate2`` beside, at its defaults (beam 4, α 0.6, 8192 tokens).
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
    """Wall seconds of whole processes translating ``lines`` with ``export``, the fastest of ``repeats`` rounds
    (each round runs both once): ``nmt translate --engine ctranslate2`` and :data:`PLAIN_CT2`."""
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


def process_main(argv: list[str]) -> int:
    """``decode.py process``: :func:`measure_processes` on a set of :func:`read_set`, printed as JSON."""
    p = argparse.ArgumentParser(prog="decode.py process", description=measure_processes.__doc__.splitlines()[0])
    p.add_argument("--export", type=Path, required=True, help="a folder `nmt export` wrote")
    p.add_argument("--data", type=Path, default=DATA, help="the shared data folder (multi30k/, wmt14/)")
    p.add_argument("--set", default="multi30k-test", choices=(*SETS, "multi30k-val"))
    p.add_argument("--repeats", type=int, default=3, help="rounds; each command's fastest counts")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    result = {"date": date.today().isoformat(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "command": " ".join(["decode.py", "process", *argv]), "set": args.set,
              **measure_processes(args.export, read_set(args.data, args.set, None)[0], args.repeats)}
    print(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["process"]:
        return process_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="NAME=path/to/averaged.pt (repeatable)")
    p.add_argument("--data", type=Path, default=DATA, help="the shared data folder (multi30k/, wmt14/)")
    p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    p.add_argument("--limit", type=int, default=1000, help="sentences per set (newstest2014 has 3,003)")
    p.add_argument("--news-limit", type=int, default=300, help="sentences of newstest2014 (long outputs)")
    p.add_argument("--single-limit", type=int, default=200, help="sentences for the one-at-a-time rows")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--quick", action="store_true", help="100 sentences per set, 1 thread")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per row (in rounds), the fastest counts")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "decode.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    unknown = sorted(set(args.sets.split(",")) - set(SETS) - {"multi30k-val"})
    if unknown:
        p.error(f"--sets {args.sets}: unknown set(s) {', '.join(unknown)}; use {', '.join(SETS)}")
    global REPEATS
    REPEATS = args.repeats
    if args.quick:
        args.limit, args.news_limit, args.single_limit, args.threads = 100, 100, 20, "1"
    result = {"date": date.today().isoformat(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "command": " ".join([Path(sys.argv[0]).name, *argv]),
              "beam": BEAM, "alpha": ALPHA, "repeats": REPEATS, "models": {}}
    for spec in args.model:
        name, _, path = spec.partition("=")
        result["models"][name] = measure_model(Path(path), args)
    print_table(result)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log.info("wrote %s", args.out)
    return 0


def measure_model(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pipeline.inference import ct2
    from pipeline.inference.common import detokenize
    from pipeline.inference.decoding import load_translator

    torch.set_num_threads(1)
    translator = load_translator(path, "cpu")
    n_params = sum(p.numel() for p in translator.model.parameters())
    val_src, val_ref = read_set(args.data, "multi30k-val", None)
    _, val_hyps = torch_row(translator, encode_all(translator, val_src), alpha=ALPHA, max_tokens=4096, threads=1)()
    out: dict[str, Any] = {"path": str(path), "parameters": n_params, "config": translator.config.to_dict(),
                           "valid_bleu": bleu(detokenize(translator.sp, val_hyps), val_ref), "sets": {}}
    log.info("%s: %d parameters, valid BLEU %.2f", path, n_params, out["valid_bleu"])
    threads = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        exports = {q: ct2.export(path, Path(tmp) / q, q) for q in ("float32", "int8")}
        for name in args.sets.split(","):
            srcs, refs = read_set(args.data, name, args.news_limit if name == "newstest2014" else args.limit)
            out["sets"][name] = measure_set(translator, exports, srcs, refs, threads=threads,
                                            single_limit=args.single_limit)
    return out


def encode_all(translator: Any, lines: list[str]) -> list[list[int]]:
    from pipeline.inference.translate import prepare_lines

    return prepare_lines(translator, lines)[0]


def print_table(result: dict[str, Any]) -> None:
    print("| model | set | threads | engine | layout | max_tokens | searches (largest) | sent/s | tok/s | mean len "
          "| same as batched | BLEU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, m in result["models"].items():
        for name, rows in m["sets"].items():
            for r in rows:
                same = "" if r["same_as_batched"] is None else f"{100 * r['same_as_batched']:.1f}%"
                plan = f"{r['searches']} ({r['largest_search']})" if "searches" in r else ""
                print(f"| {model} (valid {m['valid_bleu']}) | {name} ({r['sentences']}) | {r['threads']} | "
                      f"{r['engine']} | {r['layout']} | {r.get('max_tokens', '')} | {plan} | {r['sent_per_s']} | "
                      f"{r['tok_per_s']} | {r['mean_len']} | {same} | {r['bleu']} |")


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the whole ``nmt translate --engine ctranslate2`` process against a plain CTranslate2 script on the same
export (Multi30k test), each timed in rounds, the fastest of ``--repeats`` counting.

Usage: ``python benchmarks/decode.py process --export DIR`` (a folder ``nmt export`` wrote). The race of this
project's CPU search against CTranslate2 (``--model``) was deleted after 7013156
(``git show 7013156:benchmarks/decode.py``); its figures are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, header  # noqa: E402

DATA = Path(os.environ.get("NMT_DATA_MIRROR") or REPO.parent / "shared" / "data")


def read_set(data: Path, name: str, limit: int | None) -> tuple[list[str], list[str]]:
    """(sources, references) of ``multi30k-test`` or ``multi30k-val`` in the data mirror, first ``limit`` lines."""
    stem = {"multi30k-test": "test_2016_flickr", "multi30k-val": "val"}[name]
    src, ref = (gzip.open(data / "multi30k" / "data" / "task1" / "raw" / f"{stem}.{lang}.gz", "rt",
                          encoding="utf-8").read().splitlines() for lang in ("en", "de"))
    return src[:limit], ref[:limit]


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = p.add_subparsers(dest="mode", required=True)
    q = modes.add_parser("process", description=(measure_processes.__doc__ or "").splitlines()[0])
    q.add_argument("--export", type=Path, required=True, help="a folder `nmt export` wrote")
    q.add_argument("--data", type=Path, default=DATA, help="the shared data folder (multi30k/)")
    q.add_argument("--repeats", type=int, default=3, help="runs (in rounds), the fastest counts")
    args = p.parse_args(argv)
    if args.repeats < 1:
        q.error(f"--repeats must be >= 1, got {args.repeats}")
    result = measure_processes(args.export, read_set(args.data, "multi30k-test", None)[0], args.repeats)
    print(json.dumps({**header(argv), "set": "multi30k-test", **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the data stages: pairs/s of ``clean`` and ``encode`` against raw SentencePiece, and peak RSS, on
Multi30k train grown to 35 numbered copies (``--quick``: 4), each measurement in its own pinned subprocess.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import itertools
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, header, md_table, setup_logging, watch, write_json  # noqa: E402

DEFAULT_DATA = Path("/work/shared/data/multi30k/data/task1/raw")
PINNED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "NMT_TRACKING": "off",
          "NMT_LOG_LEVEL": "WARNING"}
SHARD_ROWS = RAW_BLOCK = 100_000
SPLITS = ("train", "valid", "test")
VOCAB = 8000
log = logging.getLogger("bench.encode")


def _read_gz(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8", newline="\n") as fh:
        return fh.read().split("\n")[:-1]


def build_corpus(data: Path, raw: Path, copies: int) -> int:
    """Write ``raw/{train,valid,test}.{en,de}``: train = ``copies`` shuffled, numbered copies."""
    en, de = _read_gz(data / "train.en.gz"), _read_gz(data / "train.de.gz")
    raw.mkdir(parents=True, exist_ok=True)
    with open(raw / "train.en", "w", encoding="utf-8") as f_en, open(raw / "train.de", "w", encoding="utf-8") as f_de:
        for c in range(copies):
            order = list(range(len(en)))
            random.Random(c).shuffle(order)
            f_en.write("".join(f"{en[i]} n{c}\n" for i in order))
            f_de.write("".join(f"{de[i]} n{c}\n" for i in order))
    for split, (lang, lines) in itertools.product(("valid", "test"), (("en", en), ("de", de))):
        (raw / f"{split}.{lang}").write_text("".join(s + "\n" for s in lines[:1000]), encoding="utf-8")
    return len(en) * copies


def train_bpe(data: Path, out: Path, vocab: int) -> None:
    """Train the BPE model once, on the original (uncopied) Multi30k train text."""
    from pipeline.bpe import train_model
    from pipeline.core.config import BpeConfig
    from pipeline.data.normalize import normalize

    out.mkdir(parents=True, exist_ok=True)
    sample = out / "sample.txt"
    text = [normalize(s) for lang in ("en", "de") for s in _read_gz(data / f"train.{lang}.gz")]
    sample.write_text("".join(s + "\n" for s in text if s), encoding="utf-8")
    train_model(sample, out / "spm", BpeConfig(vocab_size=vocab), os.cpu_count() or 1)


def _raw_chunk(args: tuple[str, str, int, int, int]) -> float:
    """Seconds encoding lines [start, end) of both clean train files, read first, in blocks of ``RAW_BLOCK``."""
    import sentencepiece as spm

    model, clean, start, end, threads = args
    sp = spm.SentencePieceProcessor(model_file=model)
    lines = []
    for lang in ("en", "de"):
        with open(Path(clean) / f"train.{lang}", encoding="utf-8") as fh:
            lines.append([s.rstrip("\n") for s in itertools.islice(fh, start, end)])
    seconds = 0.0
    for side in lines:
        for i in range(0, len(side), RAW_BLOCK):
            block = side[i:i + RAW_BLOCK]
            t = time.perf_counter()
            sp.encode(block, num_threads=threads)
            seconds += time.perf_counter() - t
    return seconds


def measure(kind: str, work: Path, workers: int) -> dict:
    """Pairs processed and seconds of one measurement."""
    from pipeline import clean, encode
    from pipeline.core.config import CleanConfig, EncodeConfig
    from pipeline.core.stage import run_stage
    from pipeline.core.textio import count_lines

    if kind in ("clean", "encode"):
        t = time.perf_counter()
        run_stage(kind, lambda: clean.stage(CleanConfig(max_ratio=3.0), raw_dir=work / "raw", clean_dir=work / "clean")
                  if kind == "clean" else encode.stage(EncodeConfig(max_len=256, shard_rows=SHARD_ROWS),
                                                       clean_dir=work / "clean", bpe_dir=work / "bpe",
                                                       shards_dir=work / "shards"), metrics_dir=work / "metrics")
        seconds = time.perf_counter() - t
        folder = work / ("raw" if kind == "clean" else "clean")
        return {"pairs": sum(count_lines(folder / f"{s}.en") for s in SPLITS), "seconds": seconds}
    n = count_lines(work / "clean" / "train.en")
    procs, threads = (workers, 1) if kind == "raw_processes" else (1, workers)
    bounds = [n * i // procs for i in range(procs + 1)]
    tasks = [(str(work / "bpe" / "spm.model"), str(work / "clean"), a, b, threads) for a, b in zip(bounds, bounds[1:])]
    with cf.ProcessPoolExecutor(procs) as pool:
        seconds = max(pool.map(_raw_chunk, tasks))
    return {"pairs": n, "seconds": seconds}


def run_measure(kind: str, work: Path, workers: int) -> dict:
    """Run :func:`measure` in a subprocess, sampling its process tree's RSS every 20 ms."""
    env = {**os.environ, **PINNED, "NMT_DATA_WORKERS": str(workers)}
    cmd = [sys.executable, __file__, "--measure", kind, "--work", str(work), "--workers", str(workers)]
    load_before = os.getloadavg()[0]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    peak_one, peak_sum = watch(proc, 0.02)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"measurement {kind} failed with exit code {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "pairs_per_s": result["pairs"] / result["seconds"],
            "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "peak_rss_mib_process": peak_one / 1024, "peak_rss_mib_tree": peak_sum / 1024}


KINDS = ("clean", "encode", "raw_processes", "raw_threads")


def bench_scale(data: Path, root: Path, copies: int, repeats: int, workers: int, vocab_dir: Path,
                kinds: tuple[str, ...] = KINDS) -> dict:
    """All measurements on one corpus size, interleaved per repeat; medians, and of the per-repeat ratios."""
    work = root / f"x{copies}"
    (work / "bpe").mkdir(parents=True)
    (work / "bpe" / "spm.model").write_bytes((vocab_dir / "spm.model").read_bytes())
    pairs = build_corpus(data, work / "raw", copies)
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for _ in range(repeats):
        for kind in kinds:
            r = run_measure(kind, work, workers)
            runs[kind].append(r)
            log.info("x%d %s: %.0f pairs/s in %.1f s, peak RSS %.0f MiB (tree %.0f MiB)", copies, kind,
                     r["pairs_per_s"], r["seconds"], r["peak_rss_mib_process"], r["peak_rss_mib_tree"])
    out: dict = {"train_pairs_raw": pairs}
    for kind, rs in runs.items():
        out[kind] = {"pairs_per_s": statistics.median(r["pairs_per_s"] for r in rs), "pairs": rs[0]["pairs"],
                     "seconds": [round(r["seconds"], 3) for r in rs], "loadavg_1m": [r["loadavg_1m"] for r in rs],
                     "peak_rss_mib_process": max(r["peak_rss_mib_process"] for r in rs),
                     "peak_rss_mib_tree": max(r["peak_rss_mib_tree"] for r in rs)}
    out["encode_vs_raw"] = statistics.median(e["pairs_per_s"] / r["pairs_per_s"]
                                             for e, r in zip(runs["encode"], runs["raw_processes"]))
    if "raw_threads" in runs:
        out["raw_processes_vs_threads"] = statistics.median(
            p["pairs_per_s"] / t["pairs_per_s"] for p, t in zip(runs["raw_processes"], runs["raw_threads"]))
    return out


def table(results: dict) -> str:
    rows = []
    for name, res in results["scales"].items():
        rows += [(name, f"{res['train_pairs_raw']:,}", kind, f"{r['pairs_per_s']:,.0f}",
                  ", ".join(f"{s:.1f}" for s in r["seconds"]),
                  f"{r['peak_rss_mib_process']:.0f} / {r['peak_rss_mib_tree']:.0f}")
                 for kind, r in ((k, res[k]) for k in KINDS if k in res)]
        rows.append((name, "", "**encode / raw SentencePiece (same processes), median of per-repeat ratios**",
                     f"**{res['encode_vs_raw']:.2f}x**", "", ""))
    return md_table(("corpus", "train pairs", "stage", "pairs/s (median)", "runs (s)",
                     "peak RSS MiB (largest process / tree)"), rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with Multi30k train.{en,de}.gz")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="4 copies, the second corpus 2x")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "encode.json")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.work, args.workers)))
        return 0
    setup_logging()
    copies, rss_factor = (4, 2) if args.quick else (35, 8)
    results: dict = {**header(argv or sys.argv[1:]), "workers": args.workers, "vocab": VOCAB, "scales": {}}
    with tempfile.TemporaryDirectory(prefix="nmt-bench-encode-") as tmp:
        root = Path(tmp)
        train_bpe(args.data, root / "bpe", VOCAB)
        for factor, repeats, kinds in ((1, args.repeats, KINDS), (rss_factor, 1, KINDS[:3])):
            results["scales"][f"{factor}x"] = bench_scale(args.data, root, copies * factor, repeats, args.workers,
                                                          root / "bpe", kinds)
            shutil.rmtree(root / f"x{copies * factor}")
    print(table(results))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

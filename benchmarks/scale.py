"""Scale benchmark: the paper profile's data stages on a synthetic corpus (``synth_corpus.py``) of WMT14 size, each
stage run as a user runs it; wall time, pairs/s, peak RSS, CPU time per thread, temporary disk, output size.

Usage: ``python benchmarks/scale.py`` (1M, 2M and 4,520,620 pairs), ``--sizes 1000000 --stages clean,encode``,
``--quick`` (20k pairs, a 2k vocabulary: seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import synth_corpus  # noqa: E402
from benchmarks.common import (  # noqa: E402
    REPO, cpu_ticks, header, md_table, setup_logging, watch, write_json, write_params)
from pipeline.data.sources import LANGS, WMT14, Corpus, DatasetSpec  # noqa: E402

STAGES = ("download", "clean", "bpe", "encode")
OUTPUT = {"download": "raw", "clean": "clean", "bpe": "bpe", "encode": "shards"}
WMT14_PAIRS = sum(c.lines for c in WMT14.train)  # 4,520,620: Europarl v7 + Common Crawl + News Commentary v9
ENV = {"NMT_TRACKING": "off", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SAMPLE_S = 0.05
DISK_EVERY = 10  # disk is walked every 10th RSS sample (0.5 s): a few files, but large folders
log = logging.getLogger("bench.scale")


def disk_bytes(root: Path) -> int:
    """Bytes allocated under ``root`` (files that vanish while walking are skipped)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def write_mirror(gen: Path, mirror: Path, spec: DatasetSpec = WMT14) -> None:
    """Lay a generated corpus (exactly ``spec``'s pairs) out as ``NMT_DATA_MIRROR`` holds ``spec``."""
    def dest(corpus: Corpus, lang: str) -> Path:
        path = mirror / spec.name / corpus.side(lang).path
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    for lang in LANGS:
        with open(gen / f"train.{lang}", "rb") as fh:
            for corpus in spec.train:
                with open(dest(corpus, lang), "wb") as out:
                    out.writelines(itertools.islice(fh, corpus.lines))
        shutil.copyfile(gen / f"valid.{lang}", dest(spec.valid[0], lang))
        lines = (gen / f"test.{lang}").read_text(encoding="utf-8").splitlines()
        segs = "".join(f'<seg id="{i}">{line}</seg>\n' for i, line in enumerate(lines, 1))
        dest(spec.test[0], lang).write_text(f'<refset setid="newstest2014">\n<doc docid="synth">\n{segs}</doc>\n'
                                            '</refset>\n', encoding="utf-8")


def run_stage(stage: str, work: Path, params: Path) -> dict:
    """Run ``python -m pipeline.<stage>``, sampling its process tree (RSS, CPU per thread) and the disk."""
    # Its own temp folder, short: multiprocessing's forkserver socket lives there (AF_UNIX paths <= 108 bytes).
    tmp = Path(tempfile.mkdtemp(prefix="nmt-scale-"))
    env = {**os.environ, **ENV, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO),  # this checkout's stages
           "NMT_DATA_MIRROR": str(work / "mirror"), "NMT_DOWNLOAD_CACHE": str(work / "cache")}
    cmd, log_file = [sys.executable, "-m", f"pipeline.{stage}", "--params", str(params)], work / f"{stage}.log"
    ticks: dict[tuple[int, int], int] = {}
    peak_disk = 0

    def also(sample: int, pids: list[int]) -> None:
        nonlocal peak_disk
        cpu_ticks(pids, ticks)
        if sample % DISK_EVERY == 0:
            peak_disk = max(peak_disk, disk_bytes(work) + disk_bytes(tmp))

    try:
        before, started = disk_bytes(work) + disk_bytes(tmp), time.monotonic()
        with open(log_file, "w", encoding="utf-8") as err:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=err)
            peak_one, peak_tree = watch(proc, SAMPLE_S, also)
        seconds, after = time.monotonic() - started, disk_bytes(work) + disk_bytes(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode:
        tail = log_file.read_text(encoding="utf-8")[-3000:]
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{tail}")
    tick = os.sysconf("SC_CLK_TCK")
    return {"seconds": seconds, "peak_rss_mib_process": peak_one / 1024, "peak_rss_mib_tree": peak_tree / 1024,
            "temp_disk_mb": max(0, peak_disk - after) / 1e6, "output_mb": disk_bytes(work / OUTPUT[stage]) / 1e6,
            "disk_growth_mb": (after - before) / 1e6, "cpu_s_total": sum(ticks.values()) / tick,
            "cpu_s_main_thread": ticks.get((proc.pid, proc.pid), 0) / tick,
            "cpu_s_busiest_thread": max(ticks.values(), default=0) / tick,
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
            "details": json.loads((work / "metrics" / f"{stage}.details.json").read_text(encoding="utf-8"))}


def bench_size(root: Path, pairs: int, stages: tuple[str, ...], *, types: int, vocab: int | None) -> dict:
    """Per-stage measurements on a corpus of ``pairs``."""
    work = root / f"pairs-{pairs}"
    corpus = synth_corpus.write_corpus(work / "gen", pairs, types=types)
    if pairs == WMT14_PAIRS and "download" in stages:  # the download stage checks each corpus' line count
        write_mirror(work / "gen", work / "mirror")
        shutil.rmtree(work / "gen")
    else:
        stages = tuple(s for s in stages if s != "download")
        (work / "gen").rename(work / "raw")
    params = yaml.safe_load((REPO / "profiles" / "paper.yaml").read_text(encoding="utf-8"))  # every path under work
    params["paths"] = {key: str(work / key) for key in params["paths"]}
    params["download"]["sha256"] = {}
    params["bpe"]["vocab_size"] = vocab or params["bpe"]["vocab_size"]
    path, runs = write_params(params, work), {}
    for stage in stages:
        runs[stage] = r = run_stage(stage, work, path)
        log.info("%d pairs %s: %.1f s, peak RSS %.0f MiB (tree %.0f), temp disk %.0f MB, output %.0f MB, CPU %.0f s "
                 "(main thread %.0f s)", pairs, stage, r["seconds"], r["peak_rss_mib_process"], r["peak_rss_mib_tree"],
                 r["temp_disk_mb"], r["output_mb"], r["cpu_s_total"], r["cpu_s_main_thread"])
    train = runs["clean"]["details"]["train"]  # raw pairs up to clean, cleaned pairs after it
    for stage, r in runs.items():
        r["pairs"] = train["pairs_in"] if stage in ("download", "clean") else train["pairs_out"]
        r["pairs_per_s"] = r["pairs"] / r["seconds"]
    shutil.rmtree(work)
    return {"corpus": {k: corpus[k] for k in ("pairs", "types", "noise", "bytes", "seconds")}, "stages": runs}


def _spin(n: int) -> float:
    started = time.perf_counter()
    total = 0
    for i in range(n):
        total += i
    return time.perf_counter() - started


def machine_speedup(n: int = 20_000_000) -> float:
    """Throughput of two processes over one on a pure-Python loop (two vCPUs can be one core's two threads)."""
    one = _spin(n)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        started = time.perf_counter()
        pool.map(_spin, [n, n])
        two = time.perf_counter() - started
    return 2 * one / two


def projection(results: dict, cores: int = 16) -> dict[str, dict]:
    """Each stage's wall time at the largest size projected to ``cores`` cores of this speed: max(main thread,
    CPU / cores) plus its waiting here, wall - max(main thread, CPU / S), S = ``machine_speedup_2_cpus``."""
    out = {}
    for stage, r in results["sizes"][-1]["stages"].items():
        cpu, main, wall = r["cpu_s_total"], r["cpu_s_main_thread"], r["seconds"]
        waiting = max(0.0, wall - max(main, cpu / results["machine_speedup_2_cpus"]))
        out[stage] = {"cpu_s": round(cpu, 1), "main_thread_s": round(main, 1),
                      "seconds": round(max(main, cpu / cores) + waiting, 1)}
    return out


def table(results: dict) -> str:
    text = md_table(("train pairs (raw)", "raw text GB", "stage", "wall s", "pairs/s", "peak RSS MiB (largest / tree)",
                     "temp disk MB", "output MB"), [
        (f"{size['corpus']['pairs']:,}", f"{sum(size['corpus']['bytes'].values()) / 1e9:.2f}", stage,
         f"{r['seconds']:.1f}", f"{r['pairs_per_s']:,.0f}" if "pairs_per_s" in r else "-",
         f"{r['peak_rss_mib_process']:,.0f} / {r['peak_rss_mib_tree']:,.0f}", f"{r['temp_disk_mb']:,.0f}",
         f"{r['output_mb']:,.0f}") for size in results["sizes"] for stage, r in size["stages"].items()])
    speedup = f"2 CPUs here give {results['machine_speedup_2_cpus']:.2f}x one CPU (pure-Python loop)."
    return f"{text}\n\n{speedup}\n\n" + md_table(
        ("stage (largest size)", "CPU s, all threads", "main thread CPU s", "projected wall s on 16 cores"),
        [(stage, f"{r['cpu_s']:.1f}", f"{r['main_thread_s']:.1f}", f"{r['seconds']:.1f}")
         for stage, r in results["projection_16_cores"].items()])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=f"1000000,2000000,{WMT14_PAIRS}",
                   help=f"comma-separated training pair counts (download runs at {WMT14_PAIRS} only)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--types", type=int, default=3_000_000, help="word forms per language in the corpus")
    p.add_argument("--vocab", type=int, help="override bpe.vocab_size (default: the paper profile's)")
    p.add_argument("--work", type=Path, help="folder for the corpora (default: a temporary folder)")
    p.add_argument("--quick", action="store_true", help="20,000 pairs, 50k word types, a 2,000-piece vocabulary")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "scale.json")
    args = p.parse_args(argv)
    setup_logging()
    if args.quick:
        args.sizes, args.types, args.vocab = "20000", 50_000, args.vocab or 2000
    stages = tuple(s for s in STAGES if s in args.stages.split(","))
    if "clean" not in stages or len(stages) != len(args.stages.split(",")):  # clean's counts give the pairs
        p.error(f"--stages: a comma-separated subset of {','.join(STAGES)} that includes clean (got {args.stages})")
    results: dict = {**header(argv if argv is not None else sys.argv[1:]), "vocab": args.vocab,
                     "machine_speedup_2_cpus": round(machine_speedup(), 3), "sizes": []}
    log.info("2 CPUs give %.2fx one CPU's throughput on a pure-Python loop", results["machine_speedup_2_cpus"])
    with tempfile.TemporaryDirectory(prefix="nmt-bench-scale-", dir=args.work) as tmp:
        for pairs in (int(s) for s in args.sizes.split(",")):
            results["sizes"].append(bench_size(Path(tmp), pairs, stages, types=args.types, vocab=args.vocab))
            results["projection_16_cores"] = projection(results)
            write_json(args.out, results)  # partial results survive
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

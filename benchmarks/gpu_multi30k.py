"""Multi30k quality on one GPU through the stage code, newstest2014 decoding, training throughput: one device call.

    python benchmarks/gpu_check.py prepare --data data/gpu --profiles multi30k     # here, on CPU
    python benchmarks/gpu_multi30k.py news --data data/gpu                         # here: the news chain's data
    python benchmarks/gpu_multi30k.py run --data data/gpu --out OUT                # on the GPU (carry data/gpu)
    python benchmarks/gpu_multi30k.py run --data D --out O --dry-run               # CPU, a few steps (tests)

Figures from a device run are in benchmarks/RESULTS.md (GPU). ``run`` does these steps and rewrites
``OUT/gpu_multi30k.json`` and ``OUT/logs.tar.gz`` after each one:

- ``sweep``: the chains named by ``--chains`` (default all): the ``multi30k`` profile, each of
  :data:`CANDIDATES` (overrides of it) and ``news`` (:data:`NEWS_CHAIN`), each one ``python -m pipeline.train``
  -> ``average`` -> ``evaluate`` in its own process, all at once on the one GPU (each wall time is then an
  upper bound on the time the run takes alone). ``evaluate`` picks beam and α on the valid set and scores
  the test set with them (Multi30k: val, test_2016_flickr; news: newstest2013, newstest2014).
- ``newstest``: the ``news`` chain's averaged model (the base dimensions, 37k pieces) translates newstest2014
  (3,003 lines, beam 4) with :func:`pipeline.inference.translate.translate_lines` (normalise, BPE, batched
  search, detokenise): a warm-up, then timed runs; sacreBLEU and the output/reference length ratio beside.
- ``throughput``: ``benchmarks/train.py --device cuda --config base-25k --compile step`` (the base model,
  37k vocabulary, ~25k target tokens per step; ``nn.Transformer`` measured in the same run).

``--budget-s`` bounds the whole run: a step that would start with too little time left is skipped, so the
JSON of what finished comes back within a device call's limit.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_check import DATA_PATHS, DATA_STAGES, Runner, params_for, step_env, write_params  # noqa: E402

log = logging.getLogger("gpu_multi30k")
PROFILE = "multi30k"
_BIG_STEPS = {"tokens_per_step": 8192, "warmup_steps": 800, "max_steps": 2000, "save_every_steps": 80,
              "valid_every_steps": 250}
#: Variants of the ``multi30k`` profile (overrides) trained beside it; each averages over its last 20% of steps.
CANDIDATES: dict[str, dict[str, dict[str, Any]]] = {
    "d512-l3": {"model": {"d_model": 512, "n_heads": 8, "d_ff": 2048}, "train": _BIG_STEPS},
    "d256-l6": {"model": {"n_layers": 6}, "train": _BIG_STEPS},
    "base": {"model": {"d_model": 512, "n_heads": 8, "d_ff": 2048, "n_layers": 6}, "train": _BIG_STEPS},
}
#: The newstest2014 decoding model: the paper profile's base dimensions and 37k vocabulary, trained on the
#: small news sets (``news`` command) long enough to stop where references stop; pre-norm, so that 6 + 6
#: layers train at this batch size (post-norm ones learned slowly: benchmarks/RESULTS.md, "GPU, third session").
NEWS_CHAIN: dict[str, dict[str, Any]] = {
    "model": {"pre_norm": True, "dropout": 0.3, "attn_dropout": 0.1, "ffn_dropout": 0.1},
    "train": {"tokens_per_step": 8192, "warmup_steps": 800, "max_steps": 1500, "save_every_steps": 60,
              "valid_every_steps": 500, "log_every_steps": 50},
    "evaluate": {"beam_sizes": [4], "alphas": [0.6, 1.0], "max_tokens": 16384},
}
CHAINS = (PROFILE, *CANDIDATES, "news")
DRY = {"model": {"d_model": 32, "n_heads": 2, "d_ff": 64, "n_layers": 1},
       "train": {"tokens_per_step": 512, "max_steps": 10, "warmup_steps": 2, "save_every_steps": 1,
                 "valid_every_steps": 5, "log_every_steps": 1},
       "average": {"last_n": 2}, "evaluate": {"beam_sizes": [1, 2], "alphas": [0.6, 1.0], "max_len_b": 5}}
#: A guard for the device call's time limit, not part of the profile: a run still going then pauses (its
#: train ``rc`` is 1 and its ``train`` metrics name the step), and its newest checkpoints are averaged.
PAUSE_MINUTES = 4.5
NEWS = ("newstest2014.en", "newstest2014.de")
NEWS_TRAIN = ("news-test2008", "newssyscomb2009", "newstest2009", "newstest2010", "newstest2011", "newstest2012")


class Clock:
    """Seconds left of ``--budget-s``."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


def _overrides(name: str) -> dict[str, dict[str, Any]]:
    """What chain ``name`` changes in its base profile (nothing for the ``multi30k`` profile itself)."""
    return NEWS_CHAIN if name == "news" else CANDIDATES.get(name, {})


def chain_params(name: str, data: Path, work: Path | None, dry: bool) -> dict:
    """``name``'s params: the ``multi30k`` profile, a candidate (overrides of it), or ``news`` (the paper profile
    on ``data/news``); run paths under ``work``."""
    params = params_for("paper" if name == "news" else PROFILE, data, work,
                        max_minutes=0 if dry else PAUSE_MINUTES)
    if name == "news":
        params["paths"].update({k: str(data / "news" / k) for k in DATA_PATHS})
    overrides = _overrides(name)
    small_bpe = {"bpe": {"vocab_size": 200}} if dry and name == "news" else {}  # the tests' few hundred lines
    for source in (overrides, DRY if dry else {}, small_bpe):  # dry: a toy model, a few steps
        for section, values in source.items():
            params[section].update(values)
    return params


def _chain(r: Runner, name: str, data: Path, dry: bool, timeout: float) -> dict[str, Any]:
    """train -> average -> evaluate of one chain; its metrics files."""
    work = r.work / name
    path = write_params(chain_params(name, data, work, dry), work)
    extra = {"NMT_MAX_TOKENS": "16384", "OMP_NUM_THREADS": "2"}
    result: dict[str, Any] = {"overrides": _overrides(name)}
    started = time.monotonic()
    for stage in ("train", "average", "evaluate"):
        left = timeout - (time.monotonic() - started)
        result[stage] = r.stage(f"{name}-{stage}", stage, path, timeout=max(left, 1), **extra)
        if result[stage]["rc"] != 0 and stage != "train":  # a paused run's checkpoints still average
            break
    for metrics in sorted((work / "metrics").glob("*.json")):
        result.setdefault("metrics", {})[metrics.stem] = json.loads(metrics.read_text(encoding="utf-8"))
    return result


def step_sweep(r: Runner, data: Path, chains: list[str], dry: bool, clock: Clock) -> dict[str, Any]:
    """Every chain in ``chains``, all at once; saved as each one ends."""
    out: dict[str, Any] = {}
    lock = threading.Lock()
    timeout = max(clock.left() - 60, 60)  # leave the newstest step its time

    def one(name: str) -> None:
        done = _chain(r, name, data, dry, timeout)
        with lock:
            out[name] = done
            r.save("sweep", out)

    with ThreadPoolExecutor(len(chains)) as pool:
        list(pool.map(one, chains))
    return out


def step_newstest(r: Runner, data: Path, chain: str, dry: bool) -> dict[str, Any]:
    """newstest2014 through ``translate_lines`` with chain ``chain``'s model: warm-up, timed runs."""
    import sacrebleu
    import torch

    from model import max_length
    from pipeline.inference.decoding import load_translator

    model_path = r.work / chain / "model" / "averaged.pt"
    src, ref = ((data / "newstest" / name).read_text(encoding="utf-8").splitlines() for name in NEWS)
    if dry:
        src, ref = src[:20], ref[:20]
    dev = torch.device("cpu" if dry else "cuda")
    started = time.perf_counter()
    translator = load_translator(model_path, dev)
    out: dict[str, Any] = {"sentences": len(src), "load_s": round(time.perf_counter() - started, 2), "runs": []}
    timed(translator, src[:200], 8192, dev)  # CUDA context, kernels, allocator
    for max_tokens in (8192, 16384, 32768, 16384):
        seconds, lines, sources, hyps = timed(translator, src, max_tokens, dev)
        out["runs"].append({"max_tokens": max_tokens, "seconds": round(seconds, 3),
                            "sentences_per_s": round(len(src) / seconds, 1)})
    bleu = sacrebleu.corpus_bleu(lines, [ref])
    out.update(bleu=round(bleu.score, 2), sys_ref_len=round(bleu.sys_len / bleu.ref_len, 3),
               mean_output_pieces=round(sum(map(len, hyps)) / len(hyps), 2),
               mean_source_pieces=round(sum(map(len, sources)) / len(sources), 2),
               at_max_length=sum(len(h) >= max_length(len(s), 1.0, 50) for h, s in zip(hyps, sources)),
               hypotheses_head=lines[:5])
    (r.work / "newstest2014.hyp.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def timed(translator: Any, lines: list[str], max_tokens: int, dev: Any) -> tuple[float, list[str], list, list]:
    """Seconds for :func:`translate_lines` on ``lines`` (beam 4, α 0.6), the GPU's queue drained."""
    import torch

    from pipeline.inference.translate import translate_lines

    started = time.perf_counter()
    text, sources, hyps, _ = translate_lines(translator, lines, beam_size=4, alpha=0.6, max_tokens=max_tokens)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, text, sources, hyps


def step_throughput(r: Runner, dry: bool, clock: Clock) -> dict[str, Any]:
    """``benchmarks/train.py`` on the base model, compiled step, beside ``nn.Transformer``."""
    json_path = r.work / "train-base-25k.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "train.py"), "--out", str(json_path)]
    argv += (["--device", "cpu", "--config", "small", "--repeats", "1", "--iters", "1"] if dry else
             ["--device", "cuda", "--config", "base-25k", "--repeats", "3", "--iters", "10", "--compile", "step"])
    done = r.cmd("throughput", argv, timeout=max(clock.left() - 10, 30))
    if json_path.is_file():
        done["result"] = json.loads(json_path.read_text(encoding="utf-8"))
    return done


def run(args: argparse.Namespace) -> int:
    clock = Clock(args.budget_s)
    r = Runner(args.out.resolve(), args.work.resolve(), "cpu" if args.dry_run else "cuda", "gpu_multi30k.json")
    r.results["commit"] = args.commit
    r.save("env", step_env())
    steps = {"sweep": (lambda: step_sweep(r, args.data, args.chains, args.dry_run, clock), 200),
             "newstest": (lambda: step_newstest(r, args.data, args.news_model, args.dry_run), 40),
             "throughput": (lambda: step_throughput(r, args.dry_run, clock), 100)}
    for name in args.steps or list(steps):
        do, needs = steps[name]
        if clock.left() < needs and not args.dry_run:
            log.warning("step %s skipped: %.0f s left, it needs ~%d", name, clock.left(), needs)
            r.save(name, {"skipped": f"{clock.left():.0f} s left"})
            continue
        r.step(name, do)
    print(json.dumps(r.results, indent=1, default=str)[-8000:])
    return 0


def news(args: argparse.Namespace) -> int:
    """The ``news`` chain's data, here (the device machine has no shared data): the small news sets of WMT14's
    ``dev.tgz`` as training pairs, newstest2013 as valid, newstest2014 as test, through clean, bpe and encode
    (the ``paper`` profile's data settings); newstest2014's text for the ``newstest`` step."""
    mirror = args.mirror / "wmt14"
    if not (mirror / "dev").is_dir() or not (mirror / "test-full-txt").is_dir():
        log.error("%s: no wmt14/dev and wmt14/test-full-txt folders here; pass --mirror, the shared data folder",
                  args.mirror)
        return 2
    target = REPO / args.data / "news"
    raw = target / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for lang in ("en", "de"):
        train = [(mirror / "dev" / f"{name}.{lang}").read_text(encoding="utf-8") for name in NEWS_TRAIN]
        (raw / f"train.{lang}").write_text("".join(t if t.endswith("\n") else t + "\n" for t in train),
                                           encoding="utf-8")
        shutil.copy(mirror / "dev" / f"newstest2013.{lang}", raw / f"valid.{lang}")
        shutil.copy(mirror / "test-full-txt" / f"newstest2014.{lang}", raw / f"test.{lang}")
    (REPO / args.data / "newstest").mkdir(exist_ok=True)
    for name in NEWS:
        shutil.copy(mirror / "test-full-txt" / name, REPO / args.data / "newstest" / name)
    r = Runner(target / "prepare", target / "prepare", "cpu")
    path = write_params(chain_params("news", args.data, None, dry=args.dry_run), target)
    for stage in DATA_STAGES[1:]:  # the raw files are written above
        if r.stage(f"news-{stage}", stage, path, timeout=1800)["rc"] != 0:
            log.error("news %s failed: see %s", stage, r.work / "logs" / f"news-{stage}.log")
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("news")
    a.add_argument("--data", type=Path, required=True, help="a folder under data/ (relative to the repository)")
    a.add_argument("--mirror", type=Path, default=REPO.parent / "shared" / "data", help="the shared data folder")
    a.add_argument("--dry-run", action="store_true", help="a 200-piece BPE, for the tests' small mirror")
    a = sub.add_parser("run")
    a.add_argument("--data", type=Path, required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--work", type=Path, default=Path("/tmp/gpu_multi30k"), help="runs and logs (default: %(default)s)")
    a.add_argument("--dry-run", action="store_true", help="CPU, a few steps: checks this script")
    a.add_argument("--steps", nargs="*", choices=["sweep", "newstest", "throughput"], help="a subset, in order")
    a.add_argument("--chains", nargs="+", choices=CHAINS, default=list(CHAINS), help="the sweep's runs")
    a.add_argument("--news-model", default="news", choices=CHAINS, help="the chain whose model decodes newstest2014")
    a.add_argument("--budget-s", type=float, default=540, help="the whole run's seconds (default: %(default)s)")
    a.add_argument("--commit", default="", help="recorded in the JSON")
    args = p.parse_args(argv)
    return {"news": news, "run": run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

"""``benchmarks/gpu.py multi30k`` and ``news``: Multi30k quality through the stage code, the ``news`` chain's data,
newstest2014 decoding."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, write_params
from benchmarks.gpu_steps.runner import DATA_STAGES, Runner, params_for, step_throughput

log = logging.getLogger("gpu")
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


def steps(r: Runner, data: Path, chains: list[str], dry: bool) -> dict[str, tuple[Any, float]]:
    """The ``multi30k`` steps in order, each with the seconds it needs on the device."""
    return {"sweep": (lambda: step_sweep(r, data, chains, dry), 200),
            "newstest": (lambda: step_newstest(r, data, dry), 40),
            "throughput": (lambda: step_throughput(r, dry), 100)}


def _overrides(name: str) -> dict[str, dict[str, Any]]:
    return NEWS_CHAIN if name == "news" else CANDIDATES.get(name, {})


def chain_params(name: str, data: Path, work: Path | None, dry: bool) -> dict:
    """``name``'s params (:data:`CHAINS`); run paths under ``work``."""
    params = params_for("paper" if name == "news" else PROFILE, data, work, dataset="news" if name == "news" else "",
                        max_minutes=0 if dry else PAUSE_MINUTES)
    small_bpe = {"bpe": {"vocab_size": 200}} if dry and name == "news" else {}  # the tests' few hundred lines
    for source in (_overrides(name), DRY if dry else {}, small_bpe):  # dry: a toy model, a few steps
        for section, values in source.items():
            params[section].update(values)
    return params


def step_sweep(r: Runner, data: Path, chains: list[str], dry: bool) -> dict[str, Any]:
    """Every chain in ``chains`` at once on the one device, train -> average -> evaluate, each saved as it ends."""
    out: dict[str, Any] = {}
    lock = threading.Lock()
    timeout = max(r.left() - 60, 60)  # leave the newstest step its time
    threads = "1" if dry else "2"  # a dry run's chains share the CPU's cores: more threads than cores crawl

    def one(name: str) -> None:
        work = r.work / name
        write_params(chain_params(name, data, work, dry), work)
        done = {"overrides": _overrides(name),
                **r.chain(name, work, timeout, NMT_MAX_TOKENS="16384", OMP_NUM_THREADS=threads)}
        with lock:
            out[name] = done
            r.save("sweep", out)

    with ThreadPoolExecutor(len(chains)) as pool:
        list(pool.map(one, chains))
    return out


def step_newstest(r: Runner, data: Path, dry: bool) -> dict[str, Any]:
    """newstest2014 through ``translate_lines`` with the ``news`` model, timed at 8k-32k tokens a batch; BLEU."""
    import sacrebleu
    import torch

    from model import max_length
    from pipeline.inference.decoding import load_translator

    src, ref = ((data / "newstest" / name).read_text(encoding="utf-8").splitlines()[:20 if dry else None]
                for name in NEWS)
    dev = torch.device("cpu" if dry else "cuda")
    started = time.perf_counter()
    translator = load_translator(r.work / "news" / "model" / "averaged.pt", dev)
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


def news_data(data: Path, mirror: Path, dry: bool) -> int:
    """The ``news`` chain's data, here: WMT14's small dev news sets to train on, newstest2013 valid, 2014 test."""
    wmt14, target = mirror / "wmt14", REPO / data / "news"
    if not (wmt14 / "dev").is_dir() or not (wmt14 / "test-full-txt").is_dir():
        log.error("%s: no wmt14/dev and wmt14/test-full-txt folders here; pass --mirror, the shared data folder",
                  mirror)
        return 2
    (raw := target / "raw").mkdir(parents=True, exist_ok=True)
    for lang in ("en", "de"):
        train = [(wmt14 / "dev" / f"{name}.{lang}").read_text(encoding="utf-8") for name in NEWS_TRAIN]
        (raw / f"train.{lang}").write_text("".join(t if t.endswith("\n") else t + "\n" for t in train),
                                           encoding="utf-8")
        shutil.copy(wmt14 / "dev" / f"newstest2013.{lang}", raw / f"valid.{lang}")
        shutil.copy(wmt14 / "test-full-txt" / f"newstest2014.{lang}", raw / f"test.{lang}")
    (REPO / data / "newstest").mkdir(exist_ok=True)
    for name in NEWS:
        shutil.copy(wmt14 / "test-full-txt" / name, REPO / data / "newstest" / name)
    r = Runner(target / "prepare", target / "prepare", "cpu")
    path = write_params(chain_params("news", data, None, dry=dry), target)
    return 0 if r.data_stages("news", path, DATA_STAGES[1:]) else 1  # the raw files are written above

"""CPU search workers: forked once per loaded model, reused by later decodes, ended by ``close``; the translations
equal one process's."""

from __future__ import annotations

import gc
import multiprocessing
import random
import warnings
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from pipeline.inference.decoding import decode_sources, load_translator, prepare_source
from pipeline.inference.workers import SearchPool
from tests.helpers.models import make_averaged


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_averaged(tmp_path_factory.mktemp("workers"), seed=5)


def _pids(pool: SearchPool) -> set[int]:
    return {p.pid for p in pool._pool._pool}  # the pool's worker processes


def test_workers_are_kept_between_decodes_and_ended_by_close(model_file: Path) -> None:
    translator = load_translator(model_file, "cpu")
    rng = random.Random(0)
    sources = [prepare_source([rng.randrange(4, translator.config.vocab_size) for _ in range(rng.randint(0, 9))],
                              translator.config)[0] for _ in range(30)]
    kwargs = {"beam_size": 3, "alphas": [0.0, 0.6], "max_len_a": 1.0, "max_len_b": 4, "max_tokens": 40}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what the workers get; one process at one thread is the reference
        alone = decode_sources(translator, sources, **kwargs)
        assert translator._pool is None  # one worker: no processes
        first = decode_sources(translator, sources, workers=2, **kwargs)
        pool = translator._pool
        assert pool is not None and len(_pids(pool)) == 2
        pids = _pids(pool)
        second = decode_sources(translator, sources[::-1], workers=2, **kwargs)
        assert translator._pool is pool and _pids(pool) == pids  # the same processes served the second decode
        assert first == alone and second == {a: h[::-1] for a, h in alone.items()}
        third = decode_sources(translator, sources, workers=3, **kwargs)  # another count: a new pool
        assert third == alone and translator._pool is not pool and len(_pids(translator._pool)) == 3
        assert pool._pool is None  # the old one was ended
    finally:
        torch.set_num_threads(threads)
        translator.close()
    assert translator._pool is None and not multiprocessing.active_children()
    translator.close()  # idempotent
    with pytest.raises(RuntimeError, match="this SearchPool is closed; make a new one"):
        pool.imap([])


def test_nmt_translate_ends_its_workers(model_file: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.en", tmp_path / "out.de"
    src.write_text("".join(f"Sentence {i} of the price.\n" for i in range(12)), encoding="utf-8")
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(["translate", "--model", str(model_file), "--input", str(src), "--output", str(out),
                         "--beam", "2", "--max-tokens", "30", "--workers", "2", "--threads", "1"]) == 0
            gc.collect()
    finally:
        torch.set_num_threads(threads)
    assert out.read_text(encoding="utf-8").count("\n") == 12 and not multiprocessing.active_children()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]  # closed, not left to the collector

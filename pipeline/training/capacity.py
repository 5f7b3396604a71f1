"""Whether this machine can hold a model for training at all, before torchrun starts (the activations come on top:
the pre-flight, pipeline/training/preflight.py, checks those with the real shapes)."""

from __future__ import annotations

import psutil

from pipeline.core import env
from pipeline.core.config import Params
from pipeline.core.errors import PipelineError

#: Bytes per weight that training keeps whatever the batch: fp32 weights, gradients and Adam's two moments.
TRAIN_BYTES_PER_WEIGHT = 16


def _available() -> tuple[int, str] | None:
    """(bytes one training process may use, where they are counted) or None when it cannot be told."""
    s = env.settings()
    if s.device != "cpu":
        import torch  # only here: the CPU path and --dry-run stay light

        if torch.cuda.is_available():
            free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
            return free, "free on the fullest GPU (torch.cuda.mem_get_info), per training process"
    available = psutil.virtual_memory().available
    procs = s.nproc or 1
    return available // procs, f"of the available memory (psutil) for each of {procs} training process(es)"


def check_memory(params: Params) -> None:
    """Refuse, naming the model.* keys, a model whose fp32 weights, gradients and Adam's two moments alone
    (:data:`TRAIN_BYTES_PER_WEIGHT` each) exceed what a training process here has; the activations come on top
    (checked by the pre-flight, pipeline/training/preflight.py). Without it a model under ``MAX_WEIGHTS`` that
    this machine cannot hold died allocating, naming no key."""
    if (found := _available()) is None:
        return
    per_process, where = found
    m = params.model
    count = m.weight_count(params.bpe.vocab_size)
    if (need := count * TRAIN_BYTES_PER_WEIGHT) <= per_process:
        return
    raise PipelineError(f"model.d_model {m.d_model}, model.d_ff {m.d_ff}, model.n_layers {m.n_layers} and "
                        f"bpe.vocab_size {params.bpe.vocab_size} make {count:.2e} weights: {need / 2**30:.1f} GiB "
                        f"for fp32 weights, gradients and Adam's moments before any activation, more than the "
                        f"{per_process / 2**30:.1f} GiB {where}; lower model.d_ff or model.d_model")

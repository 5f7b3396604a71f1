"""Everything a training run builds once (:class:`Trainer`), and resuming it from the newest checkpoint."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch

from model import Transformer, TransformerConfig
from pipeline.artifacts import checkpoint
from pipeline.artifacts.checkpoint import StateFile
from pipeline.core import env
from pipeline.core.config import RESUMABLE_TRAIN_KEYS, TrainConfig, flatten, section_dict
from pipeline.core.errors import CheckpointError, ConfigError, DataError
from pipeline.core.textio import sha256_file
from pipeline.core.yamlfile import PlainMapping
from pipeline.data import batching
from pipeline.data.shard_reader import ShardSet
from pipeline.training import distributed, forward, preflight
from pipeline.training.faults import Hooks
from pipeline.training.logs import train_flops_per_target_token
from pipeline.training.state import TrainState

log = logging.getLogger(__name__)

#: Device types whose Adam is fused (``torch.optim.Adam(fused=True)``): one such process trains without waiting for
#: the device inside a step (``pipeline/training/loop.py``). The CPU keeps the foreach Adam its results were built on.
FUSED_ADAM = ("cuda",)
# train keys that never change the trajectory: resuming with other values is allowed.


@dataclass
class Trainer:
    """The fixed parts of a run: config, process group, model, optimizer, data and its global batches."""

    cfg: TrainConfig
    seed: int
    ctx: distributed.DistContext
    model: Transformer
    optim: torch.optim.Optimizer
    train: ShardSet
    valid: ShardSet
    plan: list[batching.GlobalBatch]  # the frozen global batches (one per optimizer step), shuffled per epoch
    valid_batches: list[np.ndarray]
    max_tokens: int  # this process's padded tokens per forward pass (NMT_MAX_TOKENS): memory, not what is trained
    config: PlainMapping  # model + train + seed (checkpoints refuse to resume under another)
    shards_sha256: str
    flops_per_token: float
    hooks: Hooks
    loss: forward.BatchLoss  # one forward pass's loss sums (compiled with NMT_COMPILE)
    pass_loss: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # a training pass: (src, tgt_in, tgt_out, epsilon)


def vocab_size(spm_model: Path) -> int:
    """Piece count of the SentencePiece model (the vocabulary size)."""
    if not Path(spm_model).is_file():
        raise DataError(f"{spm_model}: BPE model not found; run the bpe stage first (dvc repro bpe)")
    return spm.SentencePieceProcessor(model_file=str(spm_model)).get_piece_size()


def check_budget(max_tokens: int, ids: np.ndarray, lengths: np.ndarray) -> None:
    """Refuse (ConfigError) a per-forward ``NMT_MAX_TOKENS`` that cannot hold the longest training pair."""
    worst = int(np.argmax(lengths))
    if lengths[worst] > max_tokens:
        raise ConfigError(env.SOURCE, [(
            f"NMT_MAX_TOKENS={max_tokens}: training pair id {ids[worst]} alone needs {lengths[worst]} padded tokens "
            f"per forward pass; set NMT_MAX_TOKENS >= {lengths[worst]} (or lower encode.max_len and rerun encode)")])


def plan(cfg: TrainConfig, train: ShardSet, lengths: tuple[np.ndarray, np.ndarray, np.ndarray], *, seed: int,
         world_size: int) -> list[batching.GlobalBatch]:
    """The run's global batches (independent of ``world_size``); DataError for an empty split or too long a pair."""
    ids, src_len, tgt_len = lengths
    if len(ids) == 0:
        raise DataError(f"{train.root}: the train split is empty; check the clean/encode stages' metrics")
    batches = batching.plan_global_batches(ids, batching.token_lengths(src_len, tgt_len), np.asarray(tgt_len) + 1,
                                           tokens_per_step=cfg.tokens_per_step, seed=seed)
    smallest = min(len(b.ids) for b in batches)
    if smallest < world_size:
        log.warning("the smallest global batch has %d pairs for %d processes: some ranks idle on such steps "
                    "(train.tokens_per_step %d)", smallest, world_size, cfg.tokens_per_step)
    return batches


def deterministic_kernels() -> None:
    """Make CUDA kernels deterministic (``NMT_DETERMINISTIC``), before the first cuBLAS call of the process."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    log.info("deterministic kernels (NMT_DETERMINISTIC): on")


def build(cfg: TrainConfig, model_cfg: TransformerConfig, seed: int, shards_dir: Path, spm_model: Path,
          ctx: distributed.DistContext, hooks: Hooks) -> Trainer:
    """Plan the global batches, build the model (same initial weights on every rank), check memory, make Adam.

    Raises:
        DataError: an empty train split, shards that do not match their manifest or the BPE model.
        ConfigError: ``NMT_MAX_TOKENS`` smaller than the longest pair.
        PipelineError: the largest forward pass does not fit in memory (pre-flight).
    """
    train, valid = ShardSet(shards_dir, "train"), ShardSet(shards_dir, "valid")
    train.check_spm(spm_model)
    for shards in (train, valid):  # once per process: a shard rewritten since encode never reaches a step
        shards.verify()
    tcfg = model_cfg.with_vocab(vocab_size(spm_model))
    lengths = train.lengths()  # read once: the plan and the FLOP count both need it
    batches = plan(cfg, train, lengths, seed=seed, world_size=ctx.world_size)
    max_tokens = env.max_tokens(ctx.device.type)
    check_budget(max_tokens, np.concatenate([b.ids for b in batches]), np.concatenate([b.lengths for b in batches]))
    v_ids, v_src, v_tgt = valid.lengths()
    valid_batches = batching.valid_plan(v_ids, batching.token_lengths(v_src, v_tgt), max_tokens=max_tokens,
                                        max_positions=tcfg.max_positions)
    if env.settings().deterministic:
        deterministic_kernels()
    torch.manual_seed(seed)  # identical initial weights on every rank and device
    model = Transformer(tcfg).to(ctx.device)
    shapes = batching.forward_shapes(batches, rank=ctx.rank, world_size=ctx.world_size, max_tokens=max_tokens)
    loss = forward.loss_function(env.settings().compile)
    preflight.check(model, preflight.largest_shapes(shapes), device=ctx.device, max_tokens=max_tokens,
                    label_smoothing=cfg.label_smoothing, rank=ctx.rank, hooks=hooks, loss=loss)
    pass_loss = training_pass(model, loss, ctx, compiled=env.settings().compile)
    fused = {"fused": True} if ctx.device.type in FUSED_ADAM else {}
    optim = torch.optim.Adam(model.parameters(), lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, **fused)
    sha = sha256_file(Path(shards_dir) / "manifest.json")
    _, src_len, tgt_len = lengths
    flops = train_flops_per_target_token(tcfg, float(src_len.mean()) + 1, float(tgt_len.mean()) + 1)
    return Trainer(cfg=cfg, seed=seed, ctx=ctx, model=model, optim=optim, train=train, valid=valid, plan=batches,
                   valid_batches=valid_batches, max_tokens=max_tokens,
                   config={"model": tcfg.to_dict(), "train": section_dict(cfg), "seed": seed}, shards_sha256=sha,
                   flops_per_token=flops, hooks=hooks, loss=loss, pass_loss=pass_loss)


def training_pass(model: Transformer, loss: forward.BatchLoss, ctx: distributed.DistContext, *,
                  compiled: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """What a training pass calls: ``loss`` on ``model`` alone, else ``DistributedDataParallel`` of the loss module.

    Compiled, the module is compiled and then wrapped, PyTorch's documented order for DDP
    (https://docs.pytorch.org/docs/stable/compile/programming_model.where_to_apply_compile.html): its frames are
    compiled inside DDP's forward, where dynamo's DDPOptimizer splits the graph at DDP's buckets
    (``torch._dynamo.config.optimize_ddp``), so each bucket's all-reduce starts during the backward pass.
    """
    if ctx.world_size == 1:
        return functools.partial(loss, model)
    module = forward.PassLoss(model, forward.lean_batch_loss if compiled else forward.batch_loss)
    if compiled:
        module.compile(dynamic=True)
    return distributed.data_parallel(module, ctx)


def check_resumable(folder: Path, state: StateFile, *, config: PlainMapping, shards_sha256: str) -> None:
    """Refuse (CheckpointError naming every differing key) to resume ``folder`` under another config or shards."""
    a, b = flatten(state.get("config", {})), flatten(config)
    keys = sorted((set(a) | set(b)) - {f"train.{k}" for k in RESUMABLE_TRAIN_KEYS})
    diffs = [f"{k}: checkpoint {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r}"
             for k in keys if a.get(k, "<absent>") != b.get(k, "<absent>")]
    if state.get("shards_sha256") != shards_sha256:
        diffs.append(f"shards manifest sha256: checkpoint {state.get('shards_sha256')!r}, now {shards_sha256!r}")
    if diffs:
        listing = "\n".join(f"  - {d}" for d in diffs)
        raise CheckpointError(
            f"{folder}: cannot resume, the run was started with another configuration or data:\n{listing}\n"
            f"Restore those params (git checkout params.yaml / the shards) to continue this run, or move "
            f"{folder.parent} away to start a new one.")


def resume(tr: Trainer, run_dir: Path) -> tuple[TrainState, str | None, int | None]:
    """The newest complete checkpoint's state, MLflow run id and world size (None when starting fresh)."""
    if tr.ctx.is_main:  # a run killed while saving: drop the half-written folder, finish the pruning
        checkpoint.clean_incomplete(run_dir)
        checkpoint.prune(run_dir, tr.cfg.keep_last)
    distributed.barrier()
    folder = checkpoint.latest(run_dir)
    if folder is None:
        return TrainState(), None, None
    saved = checkpoint.read_state(folder)
    check_resumable(folder, saved, config=tr.config, shards_sha256=tr.shards_sha256)
    tr.model.load_state_dict(checkpoint.load_tensors(folder, checkpoint.MODEL))
    tr.optim.load_state_dict(checkpoint.load_tensors(folder, checkpoint.OPTIM))
    if saved["world_size"] != tr.ctx.world_size:
        log.warning("resuming %s saved by %d processes on %d: the run continues with the same global batches but "
                    "is no longer bitwise equal to an uninterrupted one", folder, saved["world_size"],
                    tr.ctx.world_size)
    log.info("resuming from %s (step %d, epoch %d, position %d of %d)", folder, saved["step"], saved["epoch"],
             saved["position"], len(tr.plan))
    return TrainState.from_json(saved), saved.get("mlflow_run_id"), saved["world_size"]


def save(tr: Trainer, state: TrainState, run_dir: Path, run_id: str | None) -> None:
    """Checkpoint ``state`` (rank 0 writes; every rank waits for it)."""
    if tr.ctx.is_main:
        meta = state.to_json(world_size=tr.ctx.world_size, config=tr.config, shards_sha256=tr.shards_sha256,
                             mlflow_run_id=run_id)
        folder = checkpoint.save(run_dir, state.step, model_state=tr.model.state_dict(),
                                 optim_state=tr.optim.state_dict(), state=meta, keep_last=tr.cfg.keep_last,
                                 at=tr.hooks.at)
        log.info("checkpoint %s", folder)
    distributed.barrier()

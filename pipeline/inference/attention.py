"""``nmt translate --attention-png``: one sentence's cross-attention as heatmaps, one panel per head (from 1)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.inference.decoding import Translator


def check_attention_options(png: str | None, layer: int | None, line: int | None, engine: str) -> None:
    """The ``--attention-*`` options that need no model and no input, each refused in one line."""
    if not png:
        if layer is not None or line is not None:
            raise PipelineError("--attention-layer and --attention-line choose what --attention-png draws: "
                                "add --attention-png FILE")
        return
    if engine == "ctranslate2":
        raise PipelineError("--attention-png draws the torch model's attention: use it with --engine torch")
    if line is not None and line < 1:
        raise PipelineError(f"--attention-line {line}: lines are numbered from 1")
    path, folder = Path(png), Path(png).parent
    if path.is_dir():
        raise PipelineError(f"--attention-png {path}: is a folder; name a PNG file")
    if not folder.is_dir():
        raise PipelineError(f"--attention-png {path}: folder {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PipelineError(f"--attention-png {path}: folder {folder} is not writable; choose another path")


def check_attention_layer(layer: int | None, n_layers: int) -> int:
    """The decoder layer ``--attention-layer`` names, 1..``n_layers`` (None: the last); out of range: PipelineError."""
    if layer is None:
        return n_layers
    if not 1 <= layer <= n_layers:
        raise PipelineError(f"--attention-layer {layer}: the model has {n_layers} decoder layer(s); "
                            f"use 1..{n_layers} (default {n_layers}, the last)")
    return layer


def attention_figure(translator: Translator, source: Sequence[int], hyp: Sequence[int], layer: int | None) -> Any:
    """Decoder layer ``layer``'s cross-attention (1-based; None: the last) as a Figure, one panel per head."""
    import torch
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cfg = translator.config
    layer = check_attention_layer(layer, cfg.n_layers)
    dev = translator.device
    src = torch.tensor(list(source), dtype=torch.long, device=dev)
    tgt_in = torch.tensor([cfg.bos_id, *hyp], dtype=torch.long, device=dev)
    weights = translator.model.cross_attention(src, tgt_in, layer=layer - 1).float().cpu()  # [H, T, S]
    src_labels = [translator.sp.id_to_piece(int(i)) for i in source]
    tgt_labels = [translator.sp.id_to_piece(int(i)) for i in hyp] + ["</s>"]
    heads = weights.shape[0]
    cols = min(heads, 4)
    rows = -(-heads // cols)
    size = (max(4.0, 0.35 * len(src_labels) + 1.5) * cols, max(3.0, 0.3 * len(tgt_labels) + 1.5) * rows)
    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    for h in range(heads):
        ax = fig.add_subplot(rows, cols, h + 1)
        image = ax.imshow(weights[h].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(src_labels)), src_labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(tgt_labels)), tgt_labels, fontsize=7)
        ax.set_title(f"layer {layer}, head {h + 1}", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    return fig


def plot_cross_attention(translator: Translator, source: Sequence[int], hyp: Sequence[int], layer: int | None,
                         path: str | Path) -> None:
    """:func:`attention_figure` written atomically as a PNG (into a FIFO or ``/dev/stdout``)."""
    from pipeline.core.owned import atomic_path

    fig = attention_figure(translator, source, hyp, layer)
    with atomic_path(path, option="--attention-png", into_streams=True) as tmp, open(tmp, "wb") as fh:
        fig.savefig(fh, format="png", metadata={"Software": None})


@dataclass
class AttentionPick:
    """The line ``--attention-png`` draws (``wanted``, or the first non-empty one), caught as chunks go by."""

    wanted: int | None
    number: int | None = None
    source: list[int] | None = None
    hyp: list[int] | None = None

    def see(self, first: int, sources: Sequence[list[int]], hyps: Sequence[list[int]]) -> None:
        """Look at one translated chunk whose first line is line ``first``."""
        for i, source in enumerate(sources):
            if self.number is None and (first + i == self.wanted or (self.wanted is None and source)):
                self.number, self.source, self.hyp = first + i, source, hyps[i]

    def result(self, total: int) -> tuple[int, list[int], list[int]]:
        """(line number, source, hypothesis) once the input (``total`` lines) has ended; PipelineError if none."""
        if self.number is None and self.wanted is None:
            raise PipelineError("--attention-png: the input has no non-empty line to draw")
        if self.number is None:
            raise PipelineError(f"--attention-line {self.wanted}: the input ended after {total} line(s); "
                                "nothing drawn")
        if not self.source:
            raise PipelineError(f"--attention-line {self.wanted}: input line {self.wanted} is empty; "
                                "choose a non-empty line")
        return self.number, self.source, self.hyp or []


def check_attention_line(raw: Sequence[bytes], wanted: int | None, path: str) -> None:
    """Refuse an ``--attention-line`` that ``raw`` lacks or that is empty, or input without a non-empty line."""
    from pipeline.data.normalize import normalize

    def text(number: int) -> str:
        return normalize(raw[number - 1].decode("utf-8", errors="replace").replace("\0", "\ufffd"))

    if wanted is None:
        if not any(text(n) for n in range(1, len(raw) + 1)):
            raise PipelineError(f"--attention-png: {path} has no non-empty line to draw")
    elif wanted > len(raw):
        raise PipelineError(f"--attention-line {wanted}: {path} has only {len(raw)} line(s)")
    elif not text(wanted):
        raise PipelineError(f"--attention-line {wanted}: line {wanted} of {path} is empty; choose a non-empty line")

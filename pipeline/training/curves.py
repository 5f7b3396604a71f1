"""The training curves as files DVC and people read: ``valid.csv`` and ``train.png`` beside ``train.csv``.
``train.png`` needs no network (DVC's HTML loads its renderer from a CDN); it is drawn on matplotlib's Agg canvas.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Sequence
from pathlib import Path

from pipeline.core.errors import PipelineError
from pipeline.core.owned import atomic_path, write_text

log = logging.getLogger(__name__)

PNG_NAME = "train.png"
VALID_CSV_NAME = "valid.csv"
VALID_COLUMNS = ("step", "valid_loss", "valid_nll", "valid_ppl")
FIG_INCHES = (12.0, 4.0)
DPI = 100  # train.png is FIG_INCHES * DPI pixels: 1200 x 400

Row = dict[str, float | None]


def read_history(train_csv: str | Path) -> list[Row]:
    """The rows of ``train.csv`` as numbers (an empty cell is None); a missing or malformed file is a PipelineError."""
    path = Path(train_csv)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PipelineError(f"{path}: not found; rerun the train stage (`dvc repro train`)") from None
    reader = csv.DictReader(io.StringIO(text))
    if "step" not in (reader.fieldnames or ()):
        raise PipelineError(f"{path}: no 'step' column in its header; rerun the train stage (`dvc repro train`)")
    rows: list[Row] = []
    for lineno, record in enumerate(reader, start=2):
        row: Row = {}
        for column, cell in record.items():
            try:
                row[column] = float(cell) if cell not in ("", None) else None
            except ValueError:
                raise PipelineError(f"{path}: line {lineno}: column {column} is not a number ({cell!r}); "
                                    "rerun the train stage (`dvc repro train`)") from None
        rows.append(row)
    return rows


def valid_csv(rows: Sequence[Row]) -> str:
    """``valid.csv``: the rows that hold a validation, with the step and the valid columns only."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(VALID_COLUMNS)
    for row in rows:
        if row.get("valid_loss") is not None:
            writer.writerow([_cell(row.get(c)) for c in VALID_COLUMNS])
    return out.getvalue()


def _cell(value: float | None) -> str:
    """A number as ``train.csv`` writes it (an integer without ``.0``)."""
    if value is None:
        return ""
    return str(int(value)) if value.is_integer() else f"{value:.6g}"


def _series(rows: Sequence[Row], column: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows where ``column`` has a value."""
    points = [(row["step"], row[column]) for row in rows if row.get(column) is not None and row.get("step") is not None]
    return [float(s) for s, _ in points], [float(v) for _, v in points]  # type: ignore[arg-type]


def draw(rows: Sequence[Row], path: str | Path) -> None:
    """Write ``path`` (PNG, ``FIG_INCHES * DPI`` pixels): loss, perplexity and learning rate against the step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIG_INCHES, dpi=DPI)
    FigureCanvasAgg(fig)
    panels = (("loss", ("train_loss", "valid_loss"), False), ("perplexity", ("train_ppl", "valid_ppl"), True),
              ("learning rate", ("lr",), False))
    for i, (title, columns, log_y) in enumerate(panels, start=1):
        ax = fig.add_subplot(1, len(panels), i)
        for column in columns:
            steps, values = _series(rows, column)
            if steps:
                ax.plot(steps, values, marker="o" if column.startswith("valid") else None, markersize=3,
                        label=column.replace("_", " "))
        if log_y and any(ax.get_lines()):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(columns) > 1 and any(ax.get_lines()):
            ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.12, top=0.92, wspace=0.25)  # fixed: tight_layout draws twice
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})


def write_curves(train_csv: str | Path) -> tuple[Path, Path]:
    """Write ``valid.csv`` and ``train.png`` beside ``train_csv`` (each atomically); returns their paths."""
    train_csv = Path(train_csv)
    rows = read_history(train_csv)
    valid_path, png_path = train_csv.with_name(VALID_CSV_NAME), train_csv.with_name(PNG_NAME)
    write_text(valid_path, valid_csv(rows))
    draw(rows, png_path)
    log.info("wrote %s and %s (%d logged steps)", valid_path, png_path, len(rows))
    return valid_path, png_path

"""Measured items about checkpoint averaging and the development set (newstest2013 for wmt14): the averaging
span, the averaged model against the newest checkpoint alone (the setting of Table 3, §6.2) on valid BLEU and
perplexity, and the newest checkpoint's figures beside Table 3's row (base: 25.8 BLEU, 4.92 perplexity; big: 26.4,
4.33).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.auditing.items import Item, fmt, item
from pipeline.auditing.paper import comparable
from pipeline.auditing.paper_rows import BLEU_TOLERANCE, PaperRow, paper_row
from pipeline.auditing.run_items import AVERAGE_SPAN_MAX, PPL_REL, final_step

if TYPE_CHECKING:
    from pipeline.auditing.inputs import Inputs

NEWEST = "newest checkpoint"
GAIN_BLEU = "Averaged vs newest checkpoint, valid BLEU"
GAIN_PPL = "Averaged vs newest checkpoint, valid perplexity"


def _span(steps: list[int], final: int, row: PaperRow) -> tuple[str, list[str]]:
    """The span's run text and its warnings."""
    first, last, n = steps[0], steps[-1], len(steps)
    share = (final - first) / final if final else 0.0
    run = f"{n} checkpoint(s), steps {first:,}-{last:,}: the last {share * 100:.1f}% of training"
    if last != final:
        run += f" (training ended at step {final:,})"
    bad = []
    if share > AVERAGE_SPAN_MAX:
        bad.append(f"the averaged checkpoints span {share * 100:.1f}% of training (steps {first:,}-{final:,} of "
                   f"{final:,}; the paper's span is about the last {row['averaging_span']}; params.yaml's averaging "
                   f"rule allows {AVERAGE_SPAN_MAX:.0%}): early, weaker weights are in the average")
    if n != row["averaged_checkpoints"]:
        bad.append(f"{n} checkpoint(s) averaged (paper: {row['averaged_checkpoints']})")
    gaps = sorted({b - a for a, b in zip(steps, steps[1:])})
    if len(gaps) > 1:  # e.g. max_steps not a multiple of train.save_every_steps, or a max_minutes pause
        bad.append(f"the averaged checkpoints are unevenly spaced (gaps of {', '.join(f'{g:,}' for g in gaps)} "
                   "steps; the paper's are 10 minutes apart): one is off the save grid and weighs like the others")
    return run, bad


def averaging_span_item(inp: Inputs) -> Item:
    """A check: which part of training the averaged checkpoints cover (a warning past 20%)."""
    steps, row = inp.details.average.steps, paper_row(inp.params)
    final = final_step(inp) or (steps[-1] if steps else None)
    end, first = row["wall_clock_hours"] * 60, (row["averaged_checkpoints"] - 1) * row["checkpoint_minutes"]
    note = (f"span = (final step - first averaged step) / final step; the paper's first averaged checkpoint is "
            f"{first} of {end:g} minutes before the end ({first / end:.1%}), {first + row['checkpoint_minutes']} "
            f"counting the interval it was trained in ({(first + row['checkpoint_minutes']) / end:.1%})")
    if not steps or not final:
        return item("Averaging span", paper=row["averaging"], run=None, ok=None, source="§6.1, §5.2", note=note,
                    kind="check")
    run, bad = _span(steps, final, row)
    return item("Averaging span", paper=row["averaging"], run=run, ok=True, source="§6.1, §5.2", kind="check",
                note="; ".join(bad) if bad else note, verdict="warning" if bad else None)


def _averaged_paper(inp: Inputs) -> str:
    """The paper column of the two averaged-vs-newest checks."""
    return f"the reported models average the last {paper_row(inp.params)['averaged_checkpoints']} checkpoints (§6.1)"


def averaging_gain_item(inp: Inputs) -> Item:
    """A check: a warning when the newest checkpoint alone scores better valid BLEU than the averaged model."""
    averaged, newest = inp.details.evaluate.valid, inp.details.evaluate.valid_newest
    alone, mean = newest.bleu, averaged.bleu
    paper = _averaged_paper(inp)
    if alone is None or mean is None:
        return item(GAIN_BLEU, paper=paper, run=None, ok=None, source="§6.1", kind="check")
    where = f"{NEWEST} (step {newest.step:,})" if newest.step is not None else NEWEST
    run = f"averaged {mean:.2f}, {where} {alone:.2f} (sacreBLEU 13a)"
    worse = alone > mean
    note = (f"the {NEWEST} alone scores better than the average: {alone:.2f} valid BLEU vs {mean:.2f} "
            f"({alone - mean:+.2f}, sacreBLEU 13a, same beam and α); look at the averaging span and checkpoint "
            "interval" if worse else f"averaging gains {mean - alone:+.2f} valid BLEU")
    return item(GAIN_BLEU, paper=paper, run=run, ok=True, source="§6.1", kind="check", note=note,
                verdict="warning" if worse else None)


def _newest_ppl(inp: Inputs) -> tuple[float | None, str]:
    """evaluate's ``valid_newest.ppl``, else the train stage's last validation (same metric), and its source."""
    ppl, train = inp.details.evaluate.valid_newest.ppl, inp.details.train
    if ppl is not None:
        return float(ppl), "evaluate.details.json valid_newest"
    if train.valid_ppl is not None:
        return float(train.valid_ppl), f"train.details.json valid_ppl at step {fmt(train.step)}"
    return None, ""


def averaging_ppl_item(inp: Inputs) -> Item:
    """A check: a warning when the last checkpoint's valid perplexity is below the averaged model's."""
    averaged = inp.details.evaluate.valid.ppl
    last, where = _newest_ppl(inp)
    paper = _averaged_paper(inp)
    if last is None or averaged is None:
        return item(GAIN_PPL, paper=paper, run=None, ok=None, source="§6.1", kind="check")
    run = f"averaged {averaged:.2f}, {NEWEST} {last:.2f} (per BPE token, teacher-forced, no label smoothing)"
    worse = last < averaged
    note = (f"the {NEWEST} alone scores better than the average: valid perplexity {last:.2f} vs {averaged:.2f} "
            f"(per BPE token; {where})" if worse else f"averaging lowers valid perplexity by {last - averaged:.2f} "
            f"({where})")
    return item(GAIN_PPL, paper=paper, run=run, ok=True, source="§6.1", kind="check", note=note,
                verdict="warning" if worse else None)


def newest_dev_items(inp: Inputs) -> list[Item]:
    """The newest checkpoint's newstest2013 BLEU (the paper's metric) and perplexity beside Table 3's row."""
    newest, row = inp.details.evaluate.valid_newest, paper_row(inp.params)
    bleu_p, ppl_p, size = row["dev_bleu"], row["dev_ppl"], row["size"]
    same_set, why = comparable(inp, newest, "valid")
    at = f"step {newest.step:,}; " if newest.step is not None else ""
    score, sacre, ppl = newest.bleu_tok_split, newest.bleu, newest.ppl
    floor, ceiling = bleu_p - BLEU_TOLERANCE, ppl_p * (1 + PPL_REL)
    bleu_dev = f"{score or 0:.2f} (paper: {bleu_p}; matching needs >= {floor:.1f})"
    ppl_dev = f"{ppl or 0:.2f} (paper: {ppl_p}; matching needs <= {ceiling:.2f})"
    sacre_note = f"sacreBLEU 13a {sacre:.2f}; " if sacre is not None else ""
    verdict, off = (None, "") if same_set else ("informational", f"{why}: not comparable with the paper's ")
    return [
        item(f"BLEU, paper's method (tok+split), valid, {NEWEST}", paper=f"{bleu_p} (Table 3 {size}, newstest2013, no "
             "averaging)", source="Table 3, §6.2", run=None if score is None else f"{score:.2f}",
             ok=None if score is None else score >= floor, deviation=bleu_dev, verdict=verdict,
             note=(f"{off}{bleu_p}; " if off else "") + f"{at}{sacre_note}beam and α as chosen on valid"),
        item(f"Perplexity per BPE token, valid, {NEWEST}", source="Table 3",
             paper=f"{ppl_p} per wordpiece (Table 3 {size}, newstest2013)", verdict=verdict,
             run=None if ppl is None else f"{ppl:.2f}", ok=None if ppl is None else ppl <= ceiling, deviation=ppl_dev,
             note=(f"{off}{ppl_p}; " if off else "") + f"{at}teacher-forced, no label smoothing, over this run's BPE "
             "vocabulary (Table 3's is ~37k)"),
    ]


def averaged_dev_item(inp: Inputs) -> Item:
    """The averaged model's valid figures (informational: Table 3 reports single checkpoints)."""
    valid = inp.details.evaluate.valid
    parts = [f"{label} {value:.2f}" for value, label in ((valid.bleu_tok_split, "BLEU tok+split"),
                                                          (valid.bleu, "sacreBLEU 13a"), (valid.ppl, "perplexity"))
             if value is not None]
    return item("Valid set, averaged model", paper="not reported (Table 3 is without averaging, §6.2)",
                source="§6.2", run=", ".join(parts) if parts else None, ok=None, verdict="informational")


def position_item(inp: Inputs) -> Item:
    """Valid/test sources the decoder truncated at ``model.max_positions`` (the paper cuts none)."""
    cut = {"valid": inp.details.evaluate.valid.truncated_sources, "test": inp.details.evaluate.test.truncated_sources}
    known = {split: n for split, n in cut.items() if n is not None}
    limit = inp.params.model.max_positions
    run = None if not known else ", ".join(f"{split} {n:,}" for split, n in known.items())
    return item("Sources cut at max_positions", paper="none: sinusoidal positions, no length limit (§3.5)",
                source="§3.5", run=run, ok=None if not known else sum(known.values()) == 0,
                deviation=f"sources truncated at model.max_positions = {fmt(limit)}: {run}",
                note="decoded valid/test sources longer than the position table, truncated before decoding")


def dev_items(inp: Inputs) -> list[Item]:
    """Averaging span, averaged vs newest checkpoint, the newest checkpoint's dev figures, truncation."""
    return [averaging_span_item(inp), averaging_gain_item(inp), averaging_ppl_item(inp), *newest_dev_items(inp),
            averaged_dev_item(inp), position_item(inp)]

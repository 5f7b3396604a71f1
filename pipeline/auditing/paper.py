"""The paper's results as constants (with sources), and the measured items about the model, the data, test BLEU
and lineage. Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762 (sections cited as §).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.auditing.items import Item, fmt, item
from pipeline.auditing.paper_rows import BLEU_TOLERANCE, PAPER, paper_row
from pipeline.auditing.settings import approx
from pipeline.core.config import flatten, section_dict
from pipeline.core.details import EvaluateDetails, SetFigures

if TYPE_CHECKING:
    from pipeline.auditing.inputs import Inputs

def millions(n: float) -> str:
    """``63.1M``; small counts keep three decimals (``0.031M``)."""
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e6:.3f}M"


def model_items(inp: Inputs) -> list[Item]:
    """Parameter count, tied embeddings and positions, from ``averaged.pt`` (else the average stage)."""
    model, avg = inp.model, inp.details.average
    paper_n = paper_row(inp.params)["parameters"]
    if model is not None:
        n, where = model["total"], "averaged.pt state_dict (tied embedding counted once)"
    elif avg.parameters is not None:
        n, where = avg.parameters, "average.details.json"
    else:
        n, where = None, ""
    params = item("Parameters", paper=f"{paper_n // 10**6}M (Table 3)",
                  run=None if n is None else f"{n:,} ({millions(n)})",
                  ok=None if n is None else approx(n, paper_n, 0.05), source="Table 3",
                  deviation=f"{millions(n or 0)} parameters (paper: {paper_n // 10**6}M)",
                  note=f"from {where}; within 5% counts as matching (37k BPE: base 63.1M, big 214.2M)" if n else "")
    tied = item("Tied embeddings", paper="source, target and pre-softmax weights shared", source="§3.4",
                run=None if model is None else "one shared embedding" if model["tied"] else "separate matrices",
                ok=None if model is None else model["tied"], deviation="embeddings are not tied (paper: shared)")
    pos = item("Positions", paper="sinusoidal (fixed)", source="§3.5",
               run=None if model is None else "learned" if model["learned_positions"] else "sinusoidal buffer",
               ok=None if model is None else not model["learned_positions"],
               deviation="learned positions (paper: sinusoidal)")
    return [params, tied, pos]


def minor_items() -> list[Item]:
    """What model/ fixes that the paper does not state, beside tensor2tensor, read from a one-layer model and the loss
    of this code (listed last: each moves BLEU far less than the settings above); where tensor2tensor sets it
    otherwise, informational. The attention projections are judged against the tensor2tensor the paper ran (2017,
    up to v1.2.9): ``common_attention.compute_qkv`` and the output transform are ``common_layers.conv1d``, i.e.
    ``tf.layers.conv2d`` with its default ``use_bias=True``; ``use_bias=False`` arrived in v1.3.2 (December 2017)."""
    import torch

    from model import Transformer, TransformerConfig, label_smoothed_nll_loss

    net = Transformer(TransformerConfig(vocab_size=8, d_model=8, n_heads=1, d_ff=8, n_layers=1, max_positions=8))
    eps = next(m.eps for m in net.modules() if isinstance(m, torch.nn.LayerNorm))
    biases = any(m.bias is not None for n, m in net.named_modules() if n.endswith("_proj"))
    logp = torch.log_softmax(torch.arange(8.0).view(1, 8), -1)  # where ε/V and ε/(V-1) give other losses
    loss, _ = label_smoothed_nll_loss(logp, torch.tensor([7]), epsilon=0.1, ignore_index=-1)
    per_class = bool(torch.isclose(loss, 0.9 * -logp[0, 7] + 0.1 * -logp.mean()))
    t2t, info = "tensor2tensor (paper silent)", {"ok": None, "kind": "reference", "verdict": "informational"}
    return [item("Label smoothing spread", paper="ε/(V-1) to each non-target class", source=t2t, **info,
                 run="ε/V to every class, the target included" if per_class else "not ε/V to every class",
                 note="model/loss.py; fairseq spreads ε/(V-1) as tensor2tensor does"),
            item("LayerNorm ε", paper="1e-6", source=t2t, run=f"{eps:g}", note="torch.nn.LayerNorm's default", **info),
            item("Attention projection biases", paper="q, k, v and output", kind="reference", ok=biases,
                 source="tensor2tensor up to v1.2.9 (paper silent): conv1d = tf.layers.conv2d, use_bias=True; "
                        "use_bias=False from v1.3.2, December 2017",
                 run="q, k, v and output" if biases else "none",
                 deviation="no biases on the attention projections (tensor2tensor up to v1.2.9 and fairseq have them)",
                 note="model/layers.py; fairseq keeps them too")]


def data_items(inp: Inputs) -> list[Item]:
    """Training pairs downloaded and the BPE vocabulary built."""
    download, clean = inp.details.download, inp.details.clean
    pairs, kept = download.pairs.get("train"), clean.train.pairs_out
    rows = ((inp.shards_manifest or {}).get("splits") or {}).get("train", {}).get("rows")
    note = ", ".join(f"{label} {n:,}" for label, n in (("after clean", kept), ("in shards", rows)) if n is not None)
    out = [item("Training pairs (downloaded)", paper="~4.5M", source="§5.1", note=note,
                run=None if pairs is None else f"{pairs:,}", deviation=f"{pairs or 0:,} training pairs (paper: ~4.5M)",
                ok=None if pairs is None else approx(pairs, PAPER["train_pairs"], 0.05))]
    vocab = inp.details.bpe.vocab_size or (inp.shards_manifest or {}).get("vocab_size")
    out.append(item("BPE vocabulary (built)", paper="~37,000", source="§5.1",
                    run=None if vocab is None else f"{vocab:,}",
                    ok=None if vocab is None else approx(vocab, 37000, 0.05),
                    deviation=f"{vocab or 0:,} BPE pieces (paper: ~37,000)"))
    return out


def comparable(inp: Inputs, figures: SetFigures, split: str) -> tuple[bool, str]:
    """Whether a ``test`` or ``valid`` set's figures can stand beside the paper's, and why not."""
    dataset, n = inp.params.download.dataset, figures.sentences
    name, full = ("newstest2014 full", PAPER["test_sentences"]) if split == "test" else \
        ("newstest2013", PAPER["valid_sentences"])
    if dataset != "wmt14":
        return False, f"{dataset} {split} set, not {name.split()[0]}"
    if n != full and (n is not None or split == "test"):
        return False, f"{split} set of {n} sentences ({name}: {full:,})"
    return True, ""


def bleu_items(inp: Inputs) -> list[Item]:
    """Test BLEU on the paper's metric and sacreBLEU 13a (informational on another test set), and the decoding."""
    test, row = inp.details.evaluate.test, paper_row(inp.params)
    same_set, why = comparable(inp, test, "test")
    (low, high), out = row["sacrebleu_equivalent"], []
    for key, score, paper, floor, label, source in (
            ("bleu_tok_split", test.bleu_tok_split, f"{row['bleu_en_de']}", row["bleu_en_de"] - BLEU_TOLERANCE,
             "BLEU, paper's method (tok+split)", "Table 2; tensor2tensor#61"),
            ("bleu", test.bleu, f"~{low}-{high} (= {row['bleu_en_de']} on the paper's metric)", low,
             "BLEU, sacreBLEU 13a", "Table 2; Post 2018, aclanthology.org/W18-6319")):
        sig = test.signatures.get(key, "")
        notes = [] if same_set else [f"{why}: not comparable with the paper's {paper}"]
        notes += [f"signature {sig}"] if sig else []
        out.append(item(f"{label}, test", paper=paper, run=None if score is None else f"{score:.2f}",
                        ok=None if score is None else score >= floor, source=source, note="; ".join(notes),
                        deviation=f"{score or 0:.2f} (paper: {paper}; matching needs >= {floor:.1f})",
                        verdict=None if same_set else "informational"))
    if "evaluate" in inp.details.written:
        chosen = inp.details.evaluate.chosen
        out.append(item("Decoding used", paper="beam 4, α 0.6", source="§6.1",
                        ok=chosen.beam == 4 and chosen.alpha == 0.6,
                        run=f"beam {chosen.beam}, α {chosen.alpha} (chosen on valid)",
                        deviation=f"decoded with beam {chosen.beam}, α {chosen.alpha} (paper: beam 4, α 0.6)"))
    return out


def lineage_items(inp: Inputs) -> list[Item]:
    """One item: spm.model, shards, checkpoints and dvc.lock params agree with each other."""
    checks: list[str] = []
    spm = {"bpe": inp.details.bpe.spm_sha256, "average": inp.details.average.spm_sha256,
           "shards manifest": (inp.shards_manifest or {}).get("spm_sha256")}
    known = {k: v for k, v in spm.items() if v}
    if len(set(known.values())) > 1:
        checks.append("spm.model sha256 differs: " + ", ".join(f"{k} {v[:12]}" for k, v in sorted(known.items())))
    if inp.state and inp.shards_manifest_sha256 and inp.state.get("shards_sha256") != inp.shards_manifest_sha256:
        checks.append(f"{inp.state_path} was trained on shards manifest {str(inp.state.get('shards_sha256'))[:12]}, "
                      f"the shards manifest is now {inp.shards_manifest_sha256[:12]}")
    steps = inp.details.average.steps
    if steps and inp.state and steps[-1] != inp.state.get("step"):
        checks.append(f"averaged.pt ends at step {steps[-1]} but the newest checkpoint is step {inp.state.get('step')}")
    checks += _lock_param_drift(inp)
    measured = inp.lock is not None or bool(known) or inp.state is not None
    return [item("Lineage consistency", paper="-", ok=None if not measured else not checks, kind="check",
                 run=None if not measured else "consistent" if not checks else f"{len(checks)} problem(s)",
                 deviation="; ".join(checks), source="dvc.lock, manifests, metrics",
                 note="spm.model, shards, checkpoints and dvc.lock params agree with each other and params.yaml")]


def _plain(value: object) -> object:
    """PyYAML reads ``1e-09`` (no dot) as a string where DVC meant a float: compare as numbers."""
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def _lock_param_drift(inp: Inputs) -> list[str]:
    """Per dvc.lock stage, the params it recorded that differ from params.yaml (its outputs are stale)."""
    current = inp.flat
    out = []
    for stage, entry in ((inp.lock or {}).get("stages") or {}).items():
        if stage == "audit":  # its own entry is the previous audit's, rewritten after this one
            continue
        outs = [str(o.get("path")) for o in entry.get("outs") or []]
        mine = [str(v).rstrip("/") for v in section_dict(inp.params.paths).values()]
        if outs and not any(o == m or o.startswith(m + "/") for o in outs for m in mine):
            out.append(f"dvc.lock stage {stage} records other paths ({outs[0]}), not this profile's: "
                       "run `dvc repro` to record this profile's outputs")
            continue
        recorded = flatten(((entry.get("params") or {}).get("params.yaml")) or {})
        changed = [f"{key} {fmt(recorded[key])} -> {fmt(current.get(key))}" for key in sorted(recorded)
                   if _plain(current.get(key)) != _plain(recorded[key])]
        if changed:
            out.append(f"dvc.lock stage {stage} ran with other params ({', '.join(changed)}): its outputs are "
                       f"stale, run `dvc repro`")
    return out


def bleu_figures(bleu: EvaluateDetails) -> list[dict[str, str | float]]:
    """Every figure of evaluate.details.json with its signature: test, valid, then valid of the newest checkpoint."""
    rows: list[dict[str, str | float]] = []
    for split, figures in (("test", bleu.test), ("valid", bleu.valid), ("valid_newest", bleu.valid_newest)):
        scores = figures.scores()
        rows += [{"set": split, "metric": key, "score": float(score), "signature": sig}
                 for key, sig in sorted(figures.signatures.items()) if (score := scores.get(key)) is not None]
    return rows

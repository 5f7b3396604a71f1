"""Our model against its Hugging Face export (``nmt export --format hf``) on a test set, in float32 on CPU.

    python benchmarks/hf_compare.py --model runs/demo/model/averaged.pt --export runs/demo/hf \\
        --src data/multi30k/raw/test.en --ref data/multi30k/raw/test.de

Prints, as JSON: the largest logit difference (teacher-forced on the references), the share of greedy outputs
identical (the same per-sentence length limit in both), the share of beam-4 outputs identical (ours: α 0.6, GNMT's
penalty; transformers: its generation_config.json, its own length penalty and stopping rule) and both BLEUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import max_length  # noqa: E402
from pipeline.inference.decoding import load_translator  # noqa: E402
from pipeline.inference.translate import translate_lines  # noqa: E402


def _theirs(tok, model, lines: list[str], limits: list[int], beam: int) -> list[str]:  # noqa: ANN001
    out = []
    for line, limit in zip(lines, limits):
        with torch.no_grad():
            ids = model.generate(**tok(line, return_tensors="pt", truncation=True), num_beams=beam, do_sample=False,
                                 max_new_tokens=limit)[0]
        out.append(tok.decode(ids, skip_special_tokens=True))
    return out


def main() -> None:
    """Compare and print the figures."""
    import transformers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--model", "--export", "--src", "--ref"):
        p.add_argument(name, required=True)
    p.add_argument("--limit", type=int, default=0, help="first N sentences only (0: all)")
    args = p.parse_args()
    torch.set_num_threads(1)
    src = Path(args.src).read_text(encoding="utf-8").splitlines()
    ref = Path(args.ref).read_text(encoding="utf-8").splitlines()
    if args.limit:
        src, ref = src[:args.limit], ref[:args.limit]
    ours = load_translator(args.model, "cpu")
    tok = transformers.AutoTokenizer.from_pretrained(args.export)
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(args.export).eval()
    cfg = ours.config
    worst = 0.0
    for en, de in zip(src, ref):
        enc = tok(en, return_tensors="pt", truncation=True)  # to max_positions with EOS, as prepare_source cuts
        tgt_in = torch.tensor([[cfg.bos_id, *ours.sp.encode(de)][:cfg.max_positions]])
        with torch.no_grad():
            diff = (ours.model(enc.input_ids, tgt_in) - theirs(**enc, decoder_input_ids=tgt_in).logits).abs().max()
        worst = max(worst, float(diff))
    figures: dict[str, object] = {"sentences": len(src), "max_abs_logit_difference": worst}
    bleu = sacrebleu.BLEU()
    for beam in (1, 4):
        start = time.perf_counter()
        texts, sources, _, _ = translate_lines(ours, src, beam_size=beam, alpha=0.6)
        ours_s = time.perf_counter() - start
        limits = [min(max_length(len(s), 1.0, 50), cfg.max_positions) for s in sources]
        start = time.perf_counter()
        hf = _theirs(tok, theirs, src, limits, beam)
        figures[f"beam{beam}"] = {
            "identical": sum(a == b for a, b in zip(texts, hf)) / len(src),
            "bleu_ours": round(bleu.corpus_score(texts, [ref]).score, 2),
            "bleu_transformers": round(bleu.corpus_score(hf, [ref]).score, 2),
            "seconds_ours": round(ours_s, 1), "seconds_transformers": round(time.perf_counter() - start, 1)}
    figures["transformers"] = transformers.__version__
    figures["signature"] = str(bleu.get_signature())
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

"""The paper's settings, one per params key that changes results, each with its source.

Vaswani et al. 2017, arXiv:1706.03762 (sections cited as §). Where the paper is silent, the value is that of a
reference implementation, named as the source: tensor2tensor's ``transformer_base_v1`` or its beam search,
fairseq's ``transformer_wmt_en_de`` or fairseq's examples/translation/prepare-wmt14en2de.sh. Every params key is
compared here, neutral (:data:`pipeline.auditing.items.NEUTRAL_KEYS`) or left open (:data:`OPEN_KEYS`);
tests/pipeline/auditing/test_audit_paper.py walks params.yaml to keep it so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.auditing.items import Item, fmt, item
from pipeline.core.yamlfile import Plain, PlainMapping

T2T = "tensor2tensor transformer_base_v1"
FAIRSEQ = "fairseq transformer_wmt_en_de"
FAIRSEQ_PREP = "fairseq examples/translation/prepare-wmt14en2de.sh"
T2T_BEAM = "tensor2tensor utils/beam_search.py"
#: Sentences the BPE model learns from when it sees all the training text: ~4.5M pairs (§5.1), both sides.
ALL_TRAIN_SENTENCES = 2 * 4_500_000


def approx(run: float, paper: float, rel: float) -> bool:
    """Whether ``run`` is within ``rel`` (relative) of ``paper``."""
    return abs(run - paper) <= rel * abs(paper)


def at_least(value: Any, expected: Any) -> bool:
    """``value`` is 0 ("no limit") or at least ``expected``."""
    return isinstance(value, (int, float)) and (value == 0 or value >= expected)


@dataclass(frozen=True)
class Setting:
    """A paper setting: the params key(s) it maps to and how a value is judged.

    ``paper`` holds the expected value per key (one value, compared with ``derive(flat)``, when ``derive`` is set);
    ``rel`` is a relative tolerance for numbers, ``judge(value, expected)`` replaces equality, ``basis`` names
    who fixes the value (``paper`` or a reference implementation) and ``unit`` how the run's count differs from
    the source's (the same numbers then select other data: a deviation).
    """

    name: str
    keys: tuple[str, ...]
    paper: tuple[Any, ...]
    text: str
    source: str
    rel: float = 0.0
    derive: Callable[[PlainMapping], Plain] | None = None  # the value judged, from the flattened params
    judge: Callable[[Any, Any], bool] | None = None
    basis: str = "paper"
    unit: str = ""  # set: the run counts another unit than the source, a deviation even at the same numbers

    @property
    def kind(self) -> str:
        """``paper`` when the paper fixes the value, ``reference`` when a reference implementation does."""
        return "paper" if self.basis == "paper" else "reference"

    def same(self, value: Any, expected: Any) -> bool:
        """Whether one params value matches the expected one."""
        if self.judge is not None:
            return self.judge(value, expected)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        return approx(value, expected, self.rel) if numeric and self.rel else value == expected

    def check(self, flat: PlainMapping) -> Item:
        """The item for flattened params ``flat``; a deviation names each differing key."""
        if self.derive is not None:
            value = self.derive(flat)
            label = f"{self.keys[0]} / {self.keys[1]} = {fmt(value)}"
            return item(self.name, paper=self.text, run=f"{fmt(value)} (d_model / n_heads)", kind=self.kind,
                        ok=value == self.paper[0], source=self.source,
                        deviation=f"{label} ({self.basis}: {self.text})")
        bad = [f"{key} = {fmt(flat.get(key))}" for key, expected in zip(self.keys, self.paper)
               if not self.same(flat.get(key), expected)]
        run = ", ".join(f"{k.split('.')[-1]} {fmt(flat.get(k))}" for k in self.keys)
        if self.unit:
            bad.append(f"{run} in {self.unit}")
        return item(self.name, paper=self.text, run=run, ok=not bad, source=self.source, kind=self.kind,
                    deviation=f"{'; '.join(bad)} ({self.basis}: {self.text})")


S = Setting
#: pipeline/data/filters.py counts whitespace words of the raw text, before BPE; fairseq's script counts BPE tokens.
_WORDS_NOT_BPE = "whitespace words of the raw text, not BPE tokens: the same numbers drop other pairs"
_DATA: tuple[Setting, ...] = (
    S("Dataset", ("download.dataset",), ("wmt14",), "WMT14 EN-DE (~4.5M pairs)", "§5.1"),
    S("Training-pair length filter", ("clean.min_words", "clean.max_words"), (1, 250),
      "1-250 BPE tokens per side", f"paper silent; {FAIRSEQ_PREP} (clean-corpus-n.perl 1 250, after BPE)",
      basis=FAIRSEQ_PREP, unit=_WORDS_NOT_BPE),
    S("Training-pair length ratio", ("clean.max_ratio",), (1.5,), "at most 1.5 in BPE tokens",
      f"paper silent; {FAIRSEQ_PREP} (clean-corpus-n.perl -ratio 1.5, after BPE)", basis=FAIRSEQ_PREP,
      unit=_WORDS_NOT_BPE),
    S("Shared BPE vocabulary", ("bpe.vocab_size",), (37000,), "~37,000 shared source-target BPE", "§5.1", rel=0.05),
    S("BPE training text", ("bpe.input_sentence_size",), (ALL_TRAIN_SENTENCES,),
      "all training text (~9M sentences, both sides)", f"§5.1 (BPE); paper silent on sampling; {FAIRSEQ_PREP} "
      "learns BPE on all of train", judge=at_least, basis=FAIRSEQ_PREP),
    S("BPE character coverage", ("bpe.character_coverage",), (1.0,), "every character of the training text",
      f"paper silent; {FAIRSEQ_PREP}: subword-nmt BPE starts from every character", basis=FAIRSEQ_PREP),
    S("Maximum training length", ("encode.max_len",), (256,), "256 subword tokens per side",
      f"paper silent; {T2T} max_length=256", basis=T2T),
)
_MODEL: tuple[Setting, ...] = (
    S("Layers N (encoder, decoder)", ("model.n_layers",), (6,), "6", "Table 3 (base)"),
    S("d_model", ("model.d_model",), (512,), "512", "Table 3 (base)"),
    S("d_ff", ("model.d_ff",), (2048,), "2048", "Table 3 (base)"),
    S("Attention heads h", ("model.n_heads",), (8,), "8", "Table 3 (base)"),
    S("d_k = d_v", ("model.d_model", "model.n_heads"), (64,), "64", "Table 3 (base)",
      derive=lambda flat: flat["model.d_model"] // flat["model.n_heads"]),
    S("Residual dropout P_drop", ("model.dropout",), (0.1,), "0.1", "§5.4, Table 3"),
    S("Attention-weight dropout", ("model.attn_dropout",), (0.0,),
      "none: dropout only on sub-layer outputs and embedding sums",
      f"§5.4; {T2T} attention_dropout=0.0; {FAIRSEQ} attention_dropout=0.0"),
    S("FFN hidden dropout", ("model.ffn_dropout",), (0.0,),
      "none: dropout only on sub-layer outputs and embedding sums",
      f"§5.4; {T2T} relu_dropout=0.0; {FAIRSEQ} activation_dropout=0.0"),
    S("Normalisation", ("model.pre_norm",), (False,), "post-norm, LayerNorm(x + Sublayer(x))", "§3.1"),
)
_TRAIN: tuple[Setting, ...] = (
    S("Label smoothing ε_ls", ("train.label_smoothing",), (0.1,), "0.1", "§5.4, Table 3"),
    S("Adam β1, β2, ε", ("train.adam_beta1", "train.adam_beta2", "train.adam_eps"), (0.9, 0.98, 1e-9),
      "0.9, 0.98, 1e-9", "§5.3"),
    S("Weight decay", ("train.weight_decay",), (0.0,), "none (plain Adam)", f"§5.3; {T2T} weight_decay=0.0"),
    S("Gradient clipping", ("train.clip_norm",), (0.0,), "none", f"§5.3 (none described); {T2T} clip_grad_norm=0"),
    S("Learning-rate formula", ("train.lr_scale",), (1.0,),
      "lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), scale 1.0", "§5.3, eq. 3"),
    S("Warmup steps", ("train.warmup_steps",), (4000,), "4000", "§5.3"),
    S("Tokens per step", ("train.tokens_per_step",), (25000,), "~25,000 source + ~25,000 target tokens",
      "§5.1", rel=0.1),
    S("Training steps", ("train.max_steps",), (100_000,), "100,000", "§5.2, Table 3"),
    S("Epoch limit", ("train.max_epochs",), (0,), "none: 100,000 steps", "§5.2"),
    S("Checkpoint interval", ("train.save_every_steps",), (1500,),
      "every 10 minutes (~1,500 steps at 0.4 s/step)", "§6.1, §5.2", rel=0.5),
)
_AVERAGE_EVALUATE: tuple[Setting, ...] = (
    S("Checkpoints averaged", ("average.last_n",), (5,), "last 5", "§6.1"),
    S("Beam size", ("evaluate.beam_sizes",), ([4],), "4", "§6.1"),
    S("Length penalty α", ("evaluate.alphas",), ([0.6],), "0.6", "§6.1"),
    S("Beam search rule", ("evaluate.beam_rule",), ("t2t",),
      "tensor2tensor's: EOS candidates from all 2k finish; stop once no live hypothesis can beat the lowest finished "
      "score, even while fewer than k have finished",
      f"paper silent; §7 names tensor2tensor as its code: {T2T_BEAM}", basis=T2T_BEAM),
    S("Maximum output length", ("evaluate.max_len_a", "evaluate.max_len_b"), (1.0, 50), "input length + 50",
      "§6.1"),
)
PAPER_SETTINGS: tuple[Setting, ...] = _DATA + _MODEL + _TRAIN + _AVERAGE_EVALUATE
#: Transformer (big), where it differs from the base: Table 3 row big, §5.2 (300k steps at 1.0 s), §6.1.
_BIG = {s.name: s for s in (
    S("d_model", ("model.d_model",), (1024,), "1024", "Table 3 (big)"),
    S("d_ff", ("model.d_ff",), (4096,), "4096", "Table 3 (big)"),
    S("Attention heads h", ("model.n_heads",), (16,), "16", "Table 3 (big)"),
    S("Residual dropout P_drop", ("model.dropout",), (0.3,), "0.3 (EN-DE; 0.1 for EN-FR)", "§6.1, Table 3 (big)"),
    S("Training steps", ("train.max_steps",), (300_000,), "300,000", "§5.2, Table 3 (big)"),
    S("Epoch limit", ("train.max_epochs",), (0,), "none: 300,000 steps", "§5.2"),
    S("Checkpoint interval", ("train.save_every_steps",), (600,),
      "every 10 minutes (~600 steps at 1.0 s/step)", "§6.1, §5.2", rel=0.5),
    S("Checkpoints averaged", ("average.last_n",), (20,), "last 20", "§6.1"),
)}


def paper_settings(size: str) -> tuple[Setting, ...]:
    """The settings of the paper's ``base`` or ``big`` model (:func:`pipeline.auditing.paper.paper_row`)."""
    return tuple(_BIG.get(s.name, s) for s in PAPER_SETTINGS) if size == "big" else PAPER_SETTINGS


#: Keys that change results but neither the paper nor the references fix: reported without a verdict.
OPEN_KEYS: dict[str, str] = {
    "clean.dedup": f"paper silent; {FAIRSEQ_PREP} keeps duplicate pairs",
    "clean.drop_copies": f"paper silent; {FAIRSEQ_PREP} keeps pairs whose source equals the target",
}

#: Every params key some paper setting compares.
SETTING_KEYS = frozenset(key for setting in PAPER_SETTINGS for key in setting.keys)

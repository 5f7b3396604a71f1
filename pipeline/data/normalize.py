"""Sentence normalisation shared by the clean stage and ``nmt translate`` (so user input is treated
exactly as training, valid and test text)."""

from __future__ import annotations

import unicodedata


def _strip_controls(text: str) -> str:
    """Drop Cc/Cf characters; whitespace controls (tab, CR, U+0085, ...) become a space."""
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if cat == "Cc":
            if ch.isspace():
                out.append(" ")
        elif cat != "Cf":
            out.append(ch)
    return "".join(out)


def normalize(text: str) -> str:
    """Normalise one sentence (idempotently): control characters (Cc, Cf) deleted, whitespace controls made spaces,
    Unicode NFC, every run of whitespace (NBSP, U+2028 too) one ASCII space, stripped."""
    if not text.isprintable():  # fast path: plain printable text has no controls or odd spaces
        text = _strip_controls(text)
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    return " ".join(text.split())

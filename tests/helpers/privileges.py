"""Make file modes apply to a child process even when the tests run as root (as CI does)."""

from __future__ import annotations

import ctypes


def without_dac_override() -> None:
    """As root: drop CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH from the bounding set, so modes apply after exec
    (a ``preexec_fn``; raises OSError naming ``prctl(PR_CAPBSET_DROP)`` without CAP_SETPCAP)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

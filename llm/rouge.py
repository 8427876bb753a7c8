"""ROUGE-L (Lin, 2004, https://aclanthology.org/W04-1013/): longest-common-subsequence overlap.

``P = LCS / len(candidate)``, ``R = LCS / len(reference)``,
``F = (1 + beta^2) P R / (R + beta^2 P)`` (beta = 1: the harmonic mean, as reported by the
``rouge-score`` package's ``fmeasure``). Works on any sequences of comparable items: the
memorization test uses token ids, so byte-level models are scored byte by byte.
"""

from __future__ import annotations

from collections.abc import Sequence


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: Sequence, reference: Sequence, beta: float = 1.0) -> float:
    """ROUGE-L F-measure of ``candidate`` against ``reference`` in [0, 1] (0 if either is empty)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    lcs = lcs_length(candidate, reference)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return (1 + beta**2) * precision * recall / (recall + beta**2 * precision)

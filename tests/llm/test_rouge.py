"""ROUGE-L (llm.rouge) against a brute-force LCS and hand-computed values."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm.rouge import lcs_length, rouge_l


def brute_lcs(a, b):
    for n in range(min(len(a), len(b)), 0, -1):
        subs = set(itertools.combinations(a, n))
        if any(s in subs for s in itertools.combinations(b, n)):
            return n
    return 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=7), st.lists(st.integers(0, 3), max_size=7))
def test_lcs_matches_brute_force(a, b):
    assert lcs_length(a, b) == lcs_length(b, a) == brute_lcs(a, b)


def test_rouge_l_values():
    assert rouge_l("abcd", "abcd") == 1.0
    assert rouge_l("", "abc") == 0.0 and rouge_l("xyz", "abc") == 0.0
    # LCS("abcde", "ace") = 3: P = 3/5, R = 1, F = 2PR/(P+R) = 0.75
    assert rouge_l("abcde", "ace") == pytest.approx(0.75)
    assert rouge_l([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="beta"):
        rouge_l("a", "a", beta=0)

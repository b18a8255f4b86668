"""The n-gram drafter (prompt lookup: vLLM's ``ngram``, SGLang's ``NGRAM``): no weights, the
next tokens guessed from where the sequence's last tokens occurred before."""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix of
    ``tokens`` that recurs (at most ``lookup_max`` long, at least ``lookup_min``; the latest
    occurrence among equally long ones); none where no such suffix recurs."""
    last, best, best_end = len(tokens) - 1, 0, -1
    for end in range(last - 1, -1, -1):  # ``end``: where an earlier copy of the suffix ends
        matched = 0
        while (
            matched < lookup_max
            and matched <= end
            and tokens[end - matched] == tokens[last - matched]
        ):
            matched += 1
        if matched > best:
            best, best_end = matched, end
            if best == lookup_max:
                break
    if best < lookup_min:
        return []
    return list(tokens[best_end + 1 : best_end + 1 + k])

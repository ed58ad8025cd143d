"""Pairwise isolation (after DLRover's node check): when a collective between nodes fails, re-pair
the nodes of failing pairs with nodes known to be healthy; whoever still fails is the bad node."""
from __future__ import annotations

from collections.abc import Callable
from itertools import combinations

PairCheck = Callable[[str, str], bool]  # True when the pair's collective is healthy


def first_round_pairs(nodes: list[str]) -> list[tuple[str, str]]:
    """Disjoint neighbours; with an odd count the last node pairs with the first."""
    pairs = [(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
    if len(nodes) % 2 and len(nodes) > 1:
        pairs.append((nodes[-1], nodes[0]))
    return pairs


def isolate(nodes: list[str], pair_check: PairCheck,
            first_round: dict[tuple[str, str], bool] | None = None) -> list[str]:
    """Names of the bad nodes among `nodes`.

    `first_round` holds verdicts already measured for `first_round_pairs(nodes)`; without it they
    are measured here. If no pair passes even after re-pairing, there is no healthy reference and
    every suspect is returned: the fault is shared (e.g. the switch) or cannot be narrowed down.
    """
    if len(nodes) < 2:
        return []
    verdicts = dict(first_round) if first_round is not None else {p: pair_check(*p) for p in first_round_pairs(nodes)}
    good = {n for pair, ok in verdicts.items() if ok for n in pair}
    suspects = [n for n in nodes if n not in good and any(n in pair for pair in verdicts)]
    if not suspects:
        return []
    if not good:
        # Every pair failed: try untested pairs (at most one per node) until one passes, which
        # gives a healthy reference; many bad nodes are rarer than one bad switch, so stop early.
        untested = [p for p in combinations(suspects, 2) if p not in verdicts and p[::-1] not in verdicts]
        for a, b in untested[:len(nodes)]:
            verdicts[(a, b)] = ok = pair_check(a, b)
            if ok:
                good = {a, b}
                break
        if not good:
            return suspects
        suspects = [n for n in suspects if n not in good]
    refs = [n for n in nodes if n in good]
    bad = []
    for i, suspect in enumerate(suspects):
        tried = {a if b == suspect else b for (a, b) in verdicts if suspect in (a, b)}
        fresh = [r for r in refs if r not in tried] or refs
        if not pair_check(suspect, fresh[i % len(fresh)]):
            bad.append(suspect)
    return bad

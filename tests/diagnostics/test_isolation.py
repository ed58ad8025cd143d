"""Pairwise isolation names the bad node(s) with few pair tests; a fake pair check keeps it instant."""
import pytest
from megascale.diagnostics import first_round_pairs, isolate


def checker(bad: set[str]):
    calls = []

    def pair_check(a: str, b: str) -> bool:
        calls.append((a, b))
        return a not in bad and b not in bad

    return pair_check, calls


@pytest.mark.parametrize("bad_node", ["n0", "n1", "n2", "n3"])
def test_names_the_bad_node_among_four(bad_node):
    nodes = ["n0", "n1", "n2", "n3"]
    pair_check, calls = checker({bad_node})
    assert isolate(nodes, pair_check) == [bad_node]
    assert len(calls) == 4  # two first-round pairs, then each suspect against a healthy node


def test_first_round_verdicts_are_reused_and_fresh_partners_chosen():
    nodes = ["a", "b", "c"]
    assert first_round_pairs(nodes) == [("a", "b"), ("c", "a")]
    pair_check, calls = checker({"c"})
    assert isolate(nodes, pair_check, first_round={("a", "b"): True, ("c", "a"): False}) == ["c"]
    assert calls == [("c", "b")]  # not c+a again


@pytest.mark.parametrize("nodes, bad, expect", [
    (["n0", "n1", "n2", "n3", "n4", "n5"], {"n1", "n4"}, ["n1", "n4"]),
    (["n0", "n1", "n2", "n3"], set(), []),
    (["n0", "n1", "n2", "n3"], {"n0", "n2"}, ["n0", "n2"]),  # every first-round pair fails
    (["n0", "n1"], {"n1"}, ["n0", "n1"]),  # no healthy reference: both stay suspects
    (["n0"], {"n0"}, []),
])
def test_isolation_cases(nodes, bad, expect):
    pair_check, _ = checker(bad)
    assert isolate(nodes, pair_check) == expect

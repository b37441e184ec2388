"""rlmega's house (issue 39): no import circle between packages or modules, and no arrow from a lower layer to a
higher one that tools/import_graph.py does not name with its reason (docs/architecture.md, "The house")."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import import_graph as ig  # noqa: E402


def test_no_circles_between_packages_or_modules():
    assert ig.cycles(ig.graph()) == []
    assert ig.cycles(ig.graph(modules=True)) == []


def test_every_package_has_a_layer_and_arrows_point_down():
    edges = ig.graph()
    unknown = sorted(
        {p for a, bs in edges.items() for p in (a, *bs)} - {p for layer in ig.LAYERS for p in layer}
    )
    assert unknown == [], f"packages without a layer in tools/import_graph.py LAYERS: {unknown}"
    up = [arrow for arrow in ig.upward(edges) if arrow not in ig.ALLOWED]
    assert up == [], f"arrows from a lower layer up, not named in ALLOWED with why: {up}"


def test_the_graph_sees_a_lazy_import_and_a_circle():
    """The checks can fail: an import inside a function counts, and a two-node loop is a circle."""
    assert "agents" in ig.graph()["launch"]  # launch/roles.py imports rlmega.agents.hosting
    assert ig.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert ig.upward({"config": {"launch"}}) == [("config", "launch")]
    # two circles joined one way, and a 5,000-module ring: found without touching the recursion limit
    assert ig.cycles({"a": {"b"}, "b": {"c", "a"}, "c": {"d"}, "d": {"c"}}) == [
        ["c", "d"],
        ["a", "b"],
    ]
    limit = sys.getrecursionlimit()
    ring = {f"m{i:05d}": {f"m{(i + 1) % 5000:05d}"} for i in range(5000)}
    assert [len(c) for c in ig.cycles(ring)] == [5000] and sys.getrecursionlimit() == limit

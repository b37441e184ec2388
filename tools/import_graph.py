#!/usr/bin/env python3
"""rlmega's house: which package imports which, its circles, and the arrows that point up.

    python tools/import_graph.py            # edges between packages, circles, arrows against LAYERS
    python tools/import_graph.py --modules  # module-level edges instead of packages

A "package" is rlmega's first-level name (rlmega/agents/, rlmega/train.py, ...). Every import counts,
those inside functions too (they still tie the code together). LAYERS (bottom first) is the house as
docs/architecture.md draws it; an arrow from a lower layer to a higher one is "upward". Stdlib only.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rlmega"

# Bottom first; a package may import its own layer and the ones below.
LAYERS = [
    ["process", "demo"],  # what a process sets up at start; the demo's model makers
    [
        "config",
        "algorithms",
        "data",
        "rundir",
    ],  # schema and rules; pure math; batches; run folders, records
    ["sync", "rewards"],  # weights to the engines; reward functions
    ["learner", "megatron", "fsdp"],  # the learner's interface and logic; its two backends
    ["rollout", "judgers", "dashboard"],  # the engine side, judging, the web page
    ["agents"],  # trajectories, production
    ["launch"],  # the run's roles on Ray / torchrun, its coordinator
    ["step", "preflight", "train", "train_args", "cli", "__main__"],  # the driver and the commands
    ["testing"],  # tests' helpers
]
# Upward arrows kept on purpose, each with why (docs/architecture.md repeats them).
ALLOWED = {}


def package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "rlmega" and len(parts) > 1 else None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """The rlmega modules ``path`` imports (absolute and relative, at any depth)."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path).split(".")
    pkg = me if path.name == "__init__.py" else me[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rlmega"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if base.startswith("rlmega"):
                out.add(base)
                # `from rlmega import x`: x may be a module
                out.update(f"{base}.{a.name}" for a in node.names)
    return out


def graph(modules: bool = False) -> dict[str, set[str]]:
    known = {module_name(p) for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for path in sorted(ROOT.rglob("*.py")):
        src = module_name(path)
        for target in imports(path):
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target not in known:
                continue
            a, b = (src, target) if modules else (package(src), package(target))
            if a and b and a != b:
                edges[a].add(b)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative: a deep
    import chain must not need a higher recursion limit, which is process-global and would leak
    into whatever runs next in the same process, e.g. pytest's other tests)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    for root in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        work = [(root, iter(sorted(edges.get(root, ()))))]
        while work:
            v, targets = work[-1]
            w = next(targets, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer_of(pkg: str) -> int | None:
    for i, names in enumerate(LAYERS):
        if pkg in names:
            return i
    return None


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Package arrows from a lower layer to a higher one (unknown packages are reported as such)."""
    out = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            la, lb = layer_of(a), layer_of(b)
            if la is None or lb is None or lb > la:
                out.append((a, b))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", action="store_true", help="module-level edges and circles")
    args = ap.parse_args(argv)
    edges = graph(args.modules)
    for a in sorted(edges):
        print(f"{a} -> {', '.join(sorted(edges[a]))}")
    found = cycles(edges)
    print(f"\ncircles: {len(found)}")
    for c in found:
        print("  " + " <-> ".join(c))
    if not args.modules:
        up = upward(edges)
        print(f"upward arrows: {len(up)} ({sum((a, b) in ALLOWED for a, b in up)} kept on purpose)")
        for a, b in up:
            print(
                f"  {a} -> {b}" + (f": {ALLOWED[a, b]}" if (a, b) in ALLOWED else "  (not allowed)")
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The child side of the `python` tool: checks, evaluates and renders one Python expression.

The parent (rlmega.agents.tools.PythonTool) runs this file as a script in a fresh interpreter,

    python -I -S rlmega/agents/python_sandbox.py      (stdin: "MEMORY_MB CPU_S\\nEXPRESSION")

so it imports only the standard library: with -I -S neither rlmega nor site-packages is on the path.
The script caps its own address space (RLIMIT_AS) and CPU time (RLIMIT_CPU) before it compiles the
expression, then writes "ok\\nTEXT" or "error\\nEXCEPTION_TYPE\\nMESSAGE" to stdout. The parent
enforces the wall-clock limit by killing the process.

What keeps the expression in its box (each layer assumes the others may fail):
- check_source, run by the parent before a process is spawned: no "__" anywhere (no dunder
  attributes, no __import__), eval syntax only (no statements, so no import), attributes only
  from ALLOWED_ATTRIBUTES -- math's public names and the public methods of the built-in value
  types -- which leaves out the introspection attributes (gi_frame, f_back, f_globals, ...)
  that reach a frame with the real builtins;
- evaluation with SAFE_BUILTINS as the only builtins (no open, getattr, type, vars, ...);
- a separate, short-lived process with memory, CPU, file-size and core-dump limits.

Values are rendered in the tiny model's alphabet where that is cheap (render): True/False/None
as true/false/none, lists, tuples, sets and dicts with parentheses instead of brackets and braces.
"""
from __future__ import annotations

import ast
import math
import sys

MAX_SOURCE_CHARS = 2000
MAX_OUTPUT_CHARS = 1000  # the loop's format_result cuts further; this bounds the pipe
MAX_RENDER_DEPTH = 8

SAFE_BUILTIN_NAMES = (
    "abs", "min", "max", "sum", "len", "range", "round", "int", "float", "str", "bool", "sorted",
    "reversed", "pow", "divmod", "list", "tuple", "dict", "set", "all", "any", "enumerate", "zip",
    "map", "filter", "chr", "ord", "hex", "bin",
)
_BUILTINS = __builtins__ if isinstance(__builtins__, dict) else vars(__builtins__)
SAFE_BUILTINS = {name: _BUILTINS[name] for name in SAFE_BUILTIN_NAMES}
# Exception classes the expression cannot name (no builtins for them) but may raise: fine.

_VALUE_TYPES = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset, range)
# str.format/format_map read attributes by name from inside a string ("{0.x}"), around this check.
_UNSAFE_METHODS = frozenset({"format", "format_map", "mro"})
MATH_NAMES = frozenset(n for n in dir(math) if not n.startswith("_"))
METHOD_NAMES = frozenset(
    n for t in _VALUE_TYPES for n in dir(t) if not n.startswith("_") and n not in _UNSAFE_METHODS
)
ALLOWED_ATTRIBUTES = MATH_NAMES | METHOD_NAMES


def check_source(source: str) -> tuple[str, str] | None:
    """Why `source` may not be evaluated, as (error type, message), or None when it may."""
    if len(source) > MAX_SOURCE_CHARS:
        return "forbidden", f"expression longer than {MAX_SOURCE_CHARS} characters"
    if "__" in source:
        return "forbidden", "double underscores are not allowed"
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as e:
        return "syntaxerror", e.msg
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes; absurd nesting
        return type(e).__name__.lower(), str(e) or "expression too complex"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr not in ALLOWED_ATTRIBUTES:
            return "forbidden", f"attribute {node.attr} is not allowed"
    return None


def evaluate(source: str) -> object:
    """The value of the expression `source` with only SAFE_BUILTINS and `math` in scope.
    Not a sandbox on its own: call it after check_source, in a process with limits."""
    code = compile(source.strip(), "<expression>", "eval")
    return eval(code, {"__builtins__": dict(SAFE_BUILTINS), "math": math})


def _chunks(value: object, depth: int):
    """Pieces of value's rendering, lazily, so a huge list is cut without being rendered whole."""
    if value is True or value is False:
        yield "true" if value else "false"
    elif value is None:
        yield "none"
    elif isinstance(value, (list, tuple, set, frozenset, dict)):
        if depth >= MAX_RENDER_DEPTH:  # also what stops a list that contains itself
            yield "..."
            return
        if isinstance(value, (set, frozenset)) and not value:
            yield "set()"
            return
        yield "("
        for i, item in enumerate(value.items() if isinstance(value, dict) else value):
            if i:
                yield ", "
            if isinstance(value, dict):
                yield from _chunks(item[0], depth + 1)
                yield ": "
                item = item[1]
            yield from _chunks(item, depth + 1)
        if isinstance(value, tuple) and len(value) == 1:
            yield ","
        yield ")"
    else:
        yield repr(value)


def render(value: object, max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """repr-like text of `value` in the tiny vocabulary where cheap, cut after `max_chars` with " ..."."""
    parts, size = [], 0
    for chunk in _chunks(value, 0):
        parts.append(chunk)
        size += len(chunk)
        if size > max_chars:
            return "".join(parts)[:max_chars] + " ..."
    return "".join(parts)


def _limit_resources(memory_mb: int, cpu_s: int) -> None:
    import resource

    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # no file writes, should one ever open
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would otherwise dump core


def main() -> int:
    header, _, source = sys.stdin.read().partition("\n")
    memory_mb, cpu_s = (int(x) for x in header.split())
    _limit_resources(memory_mb, cpu_s)
    error = None
    try:
        text = render(evaluate(source))
    except BaseException as e:  # noqa: BLE001 -- every failure is the expression's answer
        # Only strings survive the except block, so the traceback (holding e.g. the half-built
        # list that ran out of memory) is freed before the answer is written.
        error = (type(e).__name__, str(e))
    if error is not None:
        text = None
        sys.stdout.write(f"error\n{error[0]}\n{error[1]}")
    else:
        sys.stdout.write(f"ok\n{text}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tools a multi-turn agent loop may call, by name: `calculator` and `python`.

    from rlmega.agents.tools import get_tool, run_call
    get_tool("calculator").run("12*(3+4)")                # "84"
    run_call(parse_call(turn_text), allowed=cfg.tools,    # the text to wrap in <result>...</result>
             timeout_s=cfg.tool_timeout_s, memory_mb=cfg.tool_memory_mb)

A tool's `run` never raises: whatever goes wrong becomes its answer, "error: ..." in lower-case
text, because the model is the one who has to read it (and the tiny test model's tokenizer drops
upper case and most punctuation; see tool_protocol.VOCAB_CHARACTERS). Outputs are unbounded in
principle; the loop's format_result cuts them.
"""
from __future__ import annotations

import ast
import math
import operator
import signal
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Callable

from rlmega.agents import python_sandbox
from rlmega.agents.tool_protocol import ToolCall, to_vocab

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_MB = 256


class ToolError(Exception):
    """A tool's expected failure; its message becomes the answer "error: MESSAGE"."""


def error_text(message: str) -> str:
    """"error: MESSAGE" in the tiny vocabulary (lower case, no brackets or underscores)."""
    return "error: " + to_vocab(message)


class Tool(ABC):
    """A named tool. Subclasses implement `evaluate`, which may raise; `run` never does."""

    name: str = ""
    description: str = ""  # one line for a system prompt, in the tiny vocabulary

    def run(self, args: str, timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int = DEFAULT_MEMORY_MB) -> str:
        """The tool's answer to `args`: a result, or "error: ..." text; never an exception."""
        try:
            return self.evaluate(args, timeout_s, memory_mb)
        except ToolError as e:
            return error_text(str(e))
        except Exception as e:  # noqa: BLE001 -- a tool's bug costs one answer, not the rollout
            return error_text(f"{type(e).__name__}: {e}")

    @abstractmethod
    def evaluate(self, args: str, timeout_s: float, memory_mb: int) -> str:
        """The answer to `args`; raise ToolError for an answer that is an error."""


# ---------------------------------------------------------------------------- calculator

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 100
MAX_INT_BITS = 10_000  # ~3000 digits: below Python's 4300-digit str() limit, and instant to compute

_BINARY: dict[type, Callable[[object, object], object]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[object], object]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _check_size(value: int | float) -> int | float:
    """`value` when it is a real number of bounded size; ToolError otherwise."""
    if isinstance(value, complex):  # (-8)**0.5
        raise ToolError("not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError("number too large")
    if isinstance(value, float) and not math.isfinite(value):  # 1e300*1e300, 1e999
        raise ToolError("number too large" if math.isinf(value) else "not a number")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    """base**exponent, refused before it is computed when it could take long or be huge."""
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent too large (at most {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exponent, int) and base.bit_length() * exponent > MAX_INT_BITS:
        raise ToolError("number too large")
    return base ** exponent


def _arithmetic(node: ast.AST) -> int | float:
    """The value of an arithmetic-only AST; ToolError for anything else."""
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, not complex
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arithmetic(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        return _check_size(_BINARY[type(node.op)](left, right))
    raise ToolError(f"unsupported syntax: {type(node).__name__}")


def format_number(value: int | float) -> str:
    """Integers as integers; floats with up to 6 significant digits after the point and no
    trailing zeros ("0.333333", "2.5", "1234567" for 1234567.25); very large or small floats in
    e-notation ("1e+20", "1e-07"); integral floats as integers ("2" for 4/2)."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value) or math.isinf(value):
        return str(value)  # "nan", "inf", "-inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    magnitude = abs(value)
    if 1e-6 <= magnitude < 1e15:
        decimals = max(0, 5 - math.floor(math.log10(magnitude)))
        text = f"{value:.{decimals}f}"
        text = text.rstrip("0").rstrip(".") if "." in text else text
        return "0" if text in ("-0", "") else text
    return f"{value:.6g}"


def calculate(expression: str) -> str:
    """The value of an arithmetic expression -- numbers, + - * / // % **, unary minus and
    parentheses -- as format_number text. Raises ToolError (never hangs: exponents are at most
    MAX_EXPONENT and integers at most MAX_INT_BITS bits, so "9**9**9" is refused)."""
    expression = expression.strip()
    if not expression:
        raise ToolError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError):
        raise ToolError("invalid expression") from None
    except (RecursionError, MemoryError):
        raise ToolError("expression too deep") from None
    try:
        return format_number(_arithmetic(tree))
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("number too large") from None
    except RecursionError:
        raise ToolError("expression too deep") from None


class Calculator(Tool):
    """Arithmetic, evaluated in-process from the AST (no eval): cheap and bounded without limits."""

    name = "calculator"
    description = "calculator: arithmetic with + - * / ** and parentheses, e.g. <tool>calculator:12*(3+4)</tool>"

    def evaluate(self, args: str, timeout_s: float, memory_mb: int) -> str:
        return calculate(args)


# ---------------------------------------------------------------------------- python

SANDBOX_SCRIPT = Path(python_sandbox.__file__).resolve()


def _child_failure(returncode: int, stderr: bytes, timeout_s: float) -> str:
    """The answer for a child that died without writing one."""
    if returncode == -signal.SIGXCPU:  # its CPU limit, a backstop behind the wall-clock kill
        return error_text(f"timeout after {timeout_s:g} s")
    if returncode < 0:
        return error_text(f"evaluator killed by signal {-returncode}")
    lines = stderr.decode("utf-8", errors="replace").strip().splitlines()
    return error_text(f"evaluator failed: {lines[-1] if lines else f'exit status {returncode}'}"[:200])


def parse_child_output(stdout: bytes) -> str | None:
    """The answer in the child's "ok\\nTEXT" / "error\\nTYPE\\nMESSAGE" output; None if it wrote none."""
    status, sep, rest = stdout.decode("utf-8", errors="replace").partition("\n")
    if not sep:
        return None
    if status == "ok":
        return rest
    kind, _, message = rest.partition("\n")
    if kind == "MemoryError" and not message:
        message = "out of memory"
    return error_text(f"{kind}: {message}"[:200] if message else kind)


def run_python(source: str, timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int = DEFAULT_MEMORY_MB) -> str:
    """The rendered value of the Python expression `source`, evaluated in a fresh interpreter
    with at most `memory_mb` MiB of address space and killed after `timeout_s` seconds of wall
    clock (the interpreter's start-up, ~25 ms, included); "error: ..." otherwise."""
    problem = python_sandbox.check_source(source)
    if problem is not None:
        return error_text(f"{problem[0]}: {problem[1]}")
    cpu_s = math.ceil(timeout_s) + 1
    # Limits are set by the child itself, not in preexec_fn: that is unsafe in a threaded parent
    # (a Ray actor). -I -S: no user site, no PYTHONPATH, no site-packages in the child.
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", str(SANDBOX_SCRIPT)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = proc.communicate(f"{int(memory_mb)} {cpu_s}\n{source}".encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return error_text(f"timeout after {timeout_s:g} s")
    except BaseException:  # never leave a child running, whatever interrupted the wait
        proc.kill()
        proc.communicate()
        raise
    answer = parse_child_output(stdout)
    return answer if answer is not None else _child_failure(proc.returncode, stderr, timeout_s)


class PythonTool(Tool):
    """One Python expression (not statements), evaluated in a limited child process."""

    name = "python"
    description = "python: one python expression, e.g. <tool>python:sum(range(10))</tool>"

    def evaluate(self, args: str, timeout_s: float, memory_mb: int) -> str:
        return run_python(args, timeout_s, memory_mb)


# ---------------------------------------------------------------------------- registry

TOOLS: dict[str, Tool] = {tool.name: tool for tool in (Calculator(), PythonTool())}
TOOL_NAMES: tuple[str, ...] = tuple(TOOLS)


def get_tool(name: str) -> Tool:
    """The tool called `name`; KeyError naming the known tools otherwise."""
    try:
        return TOOLS[name]
    except KeyError:
        raise KeyError(f"unknown tool {name!r}; known tools: {', '.join(TOOL_NAMES)}") from None


def run_call(call: ToolCall, allowed: Iterable[str] = TOOL_NAMES, timeout_s: float = DEFAULT_TIMEOUT_S,
             memory_mb: int = DEFAULT_MEMORY_MB) -> str:
    """The answer to one parsed call (to wrap with format_result): the tool's output, or the
    error a malformed call or a tool outside `allowed` earns. Never raises."""
    if call.malformed:
        return "error: malformed tool call"
    allowed = [name for name in allowed if name in TOOLS]
    if call.name not in allowed:
        return error_text(f"unknown tool {call.name}; tools: {', '.join(allowed)}")
    return TOOLS[call.name].run(call.args, timeout_s, memory_mb)

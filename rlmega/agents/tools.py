"""The tools a multi-turn agent loop may call, by name: `calculator`, `python` and `zoom` (an image answer).

    from rlmega.agents.tools import get_tool, run_call
    get_tool("calculator").run("12*(3+4)")                # "84"
    run_call(parse_call(turn_text), allowed=cfg.tools,    # the text to wrap in <result>...</result>
             timeout_s=cfg.tool_timeout_s, memory_mb=cfg.tool_memory_mb)

A tool's `run` never raises for what the model wrote: whatever goes wrong becomes its answer,
"error: ..." in lower-case text, because the model is the one who has to read it (and the tiny
test model's tokenizer drops upper case and most punctuation; see tool_protocol.VOCAB_CHARACTERS).
Limits out of range (NaN, inf, absurd sizes) are the caller's bug and raise ValueError. The
zoom tool (a vision-language model's) answers with an ImageResult, a box of the prompt's image enlarged. The
python tool's output is bounded (python_sandbox.MAX_OUTPUT_CHARS, MAX_CHILD_BYTES read); the
loop's format_result cuts every output further and escapes the protocol's markers in it.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import math
import operator
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Callable

from rlmega.agents import python_sandbox, zoom
from rlmega.agents.tool_protocol import ToolCall, to_vocab

# The tools' names and the bounds of a call's limits are config rules (the config's validation uses the same).
from rlmega.config.agent_rules import MAX_MEMORY_MB, MAX_TIMEOUT_S, MIN_MEMORY_MB, TOOL_NAMES

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_MB = 256


def limit_problem(timeout_s: object, memory_mb: object) -> tuple[str, str] | None:
    """(field, what is wrong with it) for tool limits out of range, or None when both are fine."""
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not (0 < timeout_s <= MAX_TIMEOUT_S)
    ):  # NaN fails every comparison: refused here
        return (
            "tool_timeout_s",
            f"{timeout_s!r} is not a number of seconds in (0, {MAX_TIMEOUT_S:g}]",
        )
    if (
        isinstance(memory_mb, bool)
        or not isinstance(memory_mb, int)
        or not (MIN_MEMORY_MB <= memory_mb <= MAX_MEMORY_MB)
    ):
        return (
            "tool_memory_mb",
            f"{memory_mb!r} is not a whole number of MiB in [{MIN_MEMORY_MB}, {MAX_MEMORY_MB}]",
        )
    return None


def check_limits(timeout_s: object, memory_mb: object) -> None:
    """ValueError naming the field when a tool call's limits are out of range (a caller's bug,
    not the model's: unlike the tool's answer, it raises)."""
    problem = limit_problem(timeout_s, memory_mb)
    if problem is not None:
        raise ValueError(f"{problem[0]}={problem[1]}")


class ToolError(Exception):
    """A tool's expected failure; its message becomes the answer "error: MESSAGE"."""


def error_text(message: str) -> str:
    """ "error: MESSAGE" in the tiny vocabulary (lower case, no brackets or underscores)."""
    return "error: " + to_vocab(message)


@dataclasses.dataclass(frozen=True)
class ImageResult:
    """A tool's answer that is an image (PNG bytes): the loop shows it to the model as an image observation
    between <result> and </result> (rlmega/agents/loop.py)."""

    png: bytes


class Tool(ABC):
    """A named tool. Subclasses implement `evaluate`, which may raise; `run` never does."""

    name: str = ""
    description: str = ""  # one line for a system prompt, in the tiny vocabulary
    sees_images = False
    """True: `evaluate` also gets the prompt's images (encoded files) and may answer with an ImageResult."""

    def run(
        self,
        args: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_mb: int = DEFAULT_MEMORY_MB,
        images: Sequence[bytes] = (),
    ) -> str | ImageResult:
        """The tool's answer to `args`: a result, or "error: ..." text; never an exception for
        anything in `args`. Limits out of range (NaN, inf, 10**8 MiB) are the caller's bug: ValueError."""
        check_limits(timeout_s, memory_mb)
        try:
            if self.sees_images:
                return self.evaluate(args, timeout_s, memory_mb, images)
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
# Nesting the evaluator accepts. Its own count, not Python's recursion limit: that limit is
# process-global (any library may raise it), so "too deep" would depend on what ran before.
MAX_DEPTH = 200

_BINARY: dict[type, Callable[[object, object], object]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
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
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and base.bit_length() * exponent > MAX_INT_BITS
    ):
        raise ToolError("number too large")
    return base**exponent


def _arithmetic(node: ast.AST, depth: int = 0) -> int | float:
    """The value of an arithmetic-only AST; ToolError for anything else or nesting past MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise ToolError("expression too deep")
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, not complex
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arithmetic(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _arithmetic(node.left, depth + 1), _arithmetic(node.right, depth + 1)
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
# What the parent reads of each of the child's pipes: the child's answer is at most
# MAX_OUTPUT_CHARS (or MAX_ERROR_CHARS) characters of up to 4 UTF-8 bytes, plus its header line.
MAX_CHILD_BYTES = 4 * python_sandbox.MAX_OUTPUT_CHARS + 256
_READ_CHUNK = 65536
_noted: set[str] = set()  # sandbox notes already logged (one line per process, not per call)


def _child_failure(returncode: int, stderr: bytes, timeout_s: float) -> str:
    """The answer for a child that died without writing one."""
    if returncode == -signal.SIGXCPU:  # its CPU limit, a backstop behind the wall-clock kill
        return error_text(f"timeout after {timeout_s:g} s")
    if returncode < 0:
        return error_text(f"evaluator killed by signal {-returncode}")
    lines = [
        line
        for line in stderr.decode("utf-8", errors="replace").strip().splitlines()
        if not line.startswith("sandbox: ")
    ]
    return error_text(
        f"evaluator failed: {lines[-1] if lines else f'exit status {returncode}'}"[:200]
    )


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


def _log_sandbox_notes(stderr: bytes) -> None:
    """Log, once per process, each layer the child's kernel refused (e.g. no network namespace)."""
    for line in stderr.decode("utf-8", errors="replace").splitlines():
        if line.startswith("sandbox: ") and line not in _noted:
            _noted.add(line)
            logger.warning(
                "python tool: %s; the other layers still hold (see rlmega/agents/python_sandbox.py)",
                line.removeprefix("sandbox: "),
            )


def _communicate_capped(
    proc: subprocess.Popen, data: bytes, timeout_s: float
) -> tuple[bytes, bytes] | None:
    """Send `data`, then read the child's stdout and stderr until both close, keeping at most
    MAX_CHILD_BYTES of each (the rest is read and dropped, so the child never blocks on a full
    pipe and the parent never holds what a runaway child writes). None past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    try:
        proc.stdin.write(data)  # a few KiB at most (MAX_SOURCE_CHARS): fits the pipe's buffer
        proc.stdin.close()
    except BrokenPipeError:  # the child died at start-up; its stderr says why
        pass
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, _READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                buffer = kept[key.fd]
                buffer += chunk[: MAX_CHILD_BYTES - len(buffer)]
    try:  # both pipes closed: it is exiting (unless a bypass closed them and carries on)
        proc.wait(max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
        return None
    return bytes(kept[proc.stdout.fileno()]), bytes(kept[proc.stderr.fileno()])


def run_python(
    source: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    *,
    layers_off: Iterable[str] = (),
) -> str:
    """The rendered value of the Python expression `source`, evaluated in a fresh, confined
    interpreter (python_sandbox's docstring lists the layers) with at most `memory_mb` MiB of
    address space and killed after `timeout_s` seconds of wall clock (the interpreter's start-up,
    ~25 ms, included); "error: ..." otherwise. ValueError for limits out of range.

    `layers_off` switches layers off (names from python_sandbox.LAYERS): for tests that attack
    one layer alone, only. Tool.run and run_call never pass it, so neither a config nor a model's
    output can reach it."""
    check_limits(timeout_s, memory_mb)
    layers_off = frozenset(layers_off)
    if not layers_off <= set(python_sandbox.LAYERS):
        raise ValueError(
            f"unknown sandbox layers {sorted(layers_off - set(python_sandbox.LAYERS))}; "
            f"known: {', '.join(python_sandbox.LAYERS)}"
        )
    problem = None if "filter" in layers_off else python_sandbox.check_source(source)
    if problem is not None:
        return error_text(f"{problem[0]}: {problem[1]}")
    cpu_s = math.ceil(timeout_s) + 1
    child_off = ",".join(sorted(layers_off & set(python_sandbox.CHILD_LAYERS))) or "-"
    workdir = None if "workdir" in layers_off else tempfile.mkdtemp(prefix="rlmega-python-tool-")
    # The root layer's jail: the work folder, or an empty folder of its own when that layer is off (tests).
    own_jail = "root" not in layers_off and workdir is None
    jail = (
        tempfile.mkdtemp(prefix="rlmega-python-jail-")
        if own_jail
        else None
        if "root" in layers_off
        else workdir
    )
    # Limits are set by the child itself, not in preexec_fn: that is unsafe in a threaded parent
    # (a Ray actor). -I -S: no user site, no PYTHONPATH, no site-packages in the child.
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(SANDBOX_SCRIPT)],
            cwd=workdir,
            env=None if "environment" in layers_off else {},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            header = f"{memory_mb} {cpu_s} {child_off} {jail or '-'}"
            outputs = _communicate_capped(proc, f"{header}\n{source}".encode(), timeout_s)
        finally:  # never leave a child running, whatever ended the wait
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                pipe.close()
    finally:
        for folder in (workdir, jail if own_jail else None):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
    if outputs is None:
        return error_text(f"timeout after {timeout_s:g} s")
    stdout, stderr = outputs
    _log_sandbox_notes(stderr)
    answer = parse_child_output(stdout)
    return answer if answer is not None else _child_failure(proc.returncode, stderr, timeout_s)


class PythonTool(Tool):
    """One Python expression (not statements), evaluated in a limited child process."""

    name = "python"
    description = "python: one python expression, e.g. <tool>python:sum(range(10))</tool>"

    def evaluate(self, args: str, timeout_s: float, memory_mb: int) -> str:
        return run_python(args, timeout_s, memory_mb)


# ---------------------------------------------------------------------------- registry

# ---------------------------------------------------------------------------- zoom


class ZoomTool(Tool):
    """A box of the prompt's image, cut out and enlarged (rlmega/agents/zoom.py): an image observation, for a
    vision-language model ("thinking with images"). In-process: PIL on an image that passed the load checks."""

    name = "zoom"
    description = (
        "zoom: look closer at a box of the image, in percent, e.g. <tool>zoom:25 25 75 75</tool>"
    )
    sees_images = True

    def evaluate(
        self, args: str, timeout_s: float, memory_mb: int, images: Sequence[bytes] = ()
    ) -> ImageResult:
        try:
            box = zoom.parse_box(args)
        except ValueError as e:
            raise ToolError(str(e)) from None
        if not images:
            raise ToolError("this prompt has no image")
        if box.image >= len(images):
            raise ToolError(f"this prompt has {len(images)} image(s)")
        return ImageResult(zoom.zoom(images[box.image], box))


# One tool per name a config may give (TOOL_NAMES, rlmega/config/agent_rules.py; tests/unit/test_tools.py
# holds the two equal).
TOOLS: dict[str, Tool] = {tool.name: tool for tool in (Calculator(), PythonTool(), ZoomTool())}


def get_tool(name: str) -> Tool:
    """The tool called `name`; KeyError naming the known tools otherwise."""
    try:
        return TOOLS[name]
    except KeyError:
        raise KeyError(f"unknown tool {name!r}; known tools: {', '.join(TOOL_NAMES)}") from None


def run_call(
    call: ToolCall,
    allowed: Iterable[str] = TOOL_NAMES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    images: Sequence[bytes] = (),
) -> str | ImageResult:
    """The answer to one parsed call (to wrap with format_result): the tool's output, or the
    error a malformed call or a tool outside `allowed` earns; an image tool's may be an ImageResult
    (`images`: the prompt's, encoded files). Raises only ValueError, for limits out of range
    (check_limits), before looking at the call."""
    check_limits(timeout_s, memory_mb)
    if call.malformed:
        return "error: malformed tool call"
    allowed = [name for name in allowed if name in TOOLS]
    if call.name not in allowed:
        return error_text(f"unknown tool {call.name}; tools: {', '.join(allowed)}")
    return TOOLS[call.name].run(call.args, timeout_s, memory_mb, images)

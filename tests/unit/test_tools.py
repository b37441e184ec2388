"""The tool-call protocol (<tool>name:args</tool>, <result>...</result>) and the calculator and python tools."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlmega.agents import python_sandbox
from rlmega.agents.tool_protocol import (
    CALL_CLOSE,
    CALL_OPEN,
    RESULT_CLOSE,
    RESULT_OPEN,
    TRUNCATION_MARK,
    VOCAB_CHARACTERS,
    ToolCall,
    format_call,
    format_result,
    parse_call,
    parse_result,
    to_vocab,
    truncate,
)
from rlmega.agents.tools import (
    TOOL_NAMES,
    TOOLS,
    Calculator,
    PythonTool,
    Tool,
    ToolError,
    calculate,
    format_number,
    get_tool,
    run_call,
    run_python,
)

# ---------------------------------------------------------------------------- protocol


def test_markers_are_in_the_tiny_vocabulary():
    from rlmega.demo.tiny_model import CHARACTERS

    assert VOCAB_CHARACTERS == frozenset(CHARACTERS)  # the copy in tool_protocol has not drifted
    for marker in (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE, TRUNCATION_MARK, ":"):
        assert set(marker) <= VOCAB_CHARACTERS


@pytest.mark.parametrize(
    "name,args",
    [
        ("calculator", "12+30"),
        ("python", "sum(range(10))"),
        ("python", "'a:b'.split(':')"),
        ("calculator", ""),
        ("calculator", " 1 + 2 "),
        ("python", "x\ny"),
    ],
)
def test_call_round_trip(name, args):
    text = format_call(name, args)
    assert text == f"<tool>{name}:{args}</tool>"
    assert parse_call(text) == ToolCall(name=name, args=args, raw=text)
    assert parse_call("let me compute. " + text) == ToolCall(name=name, args=args, raw=text)


@pytest.mark.parametrize(
    "name,args",
    [
        ("", "1"),
        (" calculator", "1"),
        ("a:b", "1"),
        ("calculator", "1</tool>"),
        ("calculator", "<tool>1"),
        ("<tool>x", "1"),
    ],
)
def test_format_call_refuses_what_cannot_round_trip(name, args):
    with pytest.raises(ValueError):
        format_call(name, args)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "the answer is 42",
        "<tool>calculator:1+2",
        "calculator:1+2</tool>",
        "</tool><tool>calculator:1+2",
        "<result>3</result>",
    ],
)
def test_no_complete_call_is_none(text):
    assert parse_call(text) is None


@pytest.mark.parametrize("inner", ["calculator", "", ":1+2", "  :1+2", "   "])
def test_malformed_call_has_an_empty_name(inner):
    call = parse_call(f"x <tool>{inner}</tool>")
    assert call is not None and call.malformed and call.name == ""
    assert call.args == inner and call.raw == f"<tool>{inner}</tool>"


def test_last_call_is_the_one_that_counts():
    text = "<tool>calculator:1+1</tool><result>2</result> then <tool>python:2*3</tool>"
    assert parse_call(text) == ToolCall("python", "2*3", "<tool>python:2*3</tool>")
    # An unclosed opener after the last complete call does not hide it; of nested openers the
    # innermost one counts.
    assert parse_call("<tool>calculator:1</tool> <tool>python:2").name == "calculator"
    assert parse_call("<tool>junk <tool>calculator:5*5</tool>") == ToolCall(
        "calculator", "5*5", "<tool>calculator:5*5</tool>"
    )


def test_call_split_at_first_colon_and_name_stripped():
    call = parse_call("<tool> python :'a:b'</tool>")
    assert (call.name, call.args) == ("python", "'a:b'")


def test_format_result_and_truncation():
    assert format_result("42") == "<result>42</result>"
    assert parse_result(format_result("error: division by zero")) == "error: division by zero"
    assert parse_result("no result here") is None
    long = "7" * 500
    body = parse_result(format_result(long))
    assert len(body) == 200 and body.endswith(TRUNCATION_MARK) and body.startswith("7" * 100)
    assert (
        parse_result(format_result(long, max_chars=20))
        == "7" * (20 - len(TRUNCATION_MARK)) + TRUNCATION_MARK
    )
    # exactly at the limit: untouched
    assert format_result("x" * 200) == f"<result>{'x' * 200}</result>"
    assert truncate("abcdef", 3) == "abc" and truncate("abc", 0) == ""  # no room for the mark


def test_to_vocab():
    assert (
        to_vocab("ZeroDivisionError: [1, 2] {a} x_y\tz\u00e9")
        == "zerodivisionerror: (1, 2) (a) x y z"
    )
    assert set(to_vocab("".join(map(chr, range(32, 127))))) <= VOCAB_CHARACTERS


# ---------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression,expected",
    [
        ("1+2", "3"),
        ("12*(3+4)", "84"),
        (" 7 - 10 ", "-3"),
        ("-5", "-5"),
        ("--5", "5"),
        ("+5", "5"),
        ("2**10", "1024"),
        ("2**-1", "0.5"),
        ("(-2)**3", "-8"),
        ("-2**2", "-4"),
        ("2**100", str(2**100)),
        ("1/3", "0.333333"),
        ("2/3", "0.666667"),
        ("4/2", "2"),
        ("7/2", "3.5"),
        ("0.1+0.2", "0.3"),
        ("7//2", "3"),
        ("-7//2", "-4"),
        ("7%3", "1"),
        ("7.5%2", "1.5"),
        ("1e-7", "1e-07"),
        ("1e20", "1e+20"),
        ("2000000/2", "1000000"),
        ("3.14159265", "3.14159"),
        ("100/7", "14.2857"),
        ("-0.0", "0"),
        ("((((1))))", "1"),
        ("1.0", "1"),
        ("9**0.5", "3"),
        ("2**0.5", "1.41421"),
    ],
)
def test_calculator_values(expression, expected):
    assert calculate(expression) == expected
    assert get_tool("calculator").run(expression) == expected


@pytest.mark.parametrize(
    "expression,expected",
    [
        ("1/0", "error: division by zero"),
        ("1//0", "error: division by zero"),
        ("5%0", "error: division by zero"),
        ("0**-1", "error: division by zero"),
        ("1.5/0.0", "error: division by zero"),
        ("9**9**9", "error: exponent too large (at most 100)"),
        ("2**101", "error: exponent too large (at most 100)"),
        ("(2**100)**100", "error: number too large"),
        ("(10**90)**90*1.5", "error: number too large"),
        ("1e300*1e300", "error: number too large"),
        ("1e999", "error: number too large"),
        ("1e300**2", "error: number too large"),
        ("(-8)**0.5", "error: not a real number"),
        ("", "error: empty expression"),
        ("   ", "error: empty expression"),
        ("1+", "error: invalid expression"),
        ("1 2", "error: invalid expression"),
        ("abs(-1)", "error: unsupported syntax: call"),
        ("x+1", "error: unsupported syntax: name"),
        ("1<2", "error: unsupported syntax: compare"),
        ("'a'*3", "error: unsupported syntax: constant"),
        ("True+1", "error: unsupported syntax: constant"),
        ("1j", "error: unsupported syntax: constant"),
        ("math.pi", "error: unsupported syntax: attribute"),
        ("2 & 3", "error: unsupported syntax: binop"),
        ("import os", "error: invalid expression"),
        ("1" * 1001, "error: expression longer than 1000 characters"),
        ("-" * 990 + "1", "error: expression too deep"),
        ("(" * 300 + "1" + ")" * 300, "error: invalid expression"),
    ],
)
def test_calculator_errors(expression, expected):
    started = time.monotonic()
    assert Calculator().run(expression) == expected
    assert time.monotonic() - started < 1.0  # refused, not computed


def test_calculator_depth_is_its_own_limit_not_the_interpreters():
    """A process that raised Python's recursion limit (CI once ran a test that did) still refuses
    the same nesting: the limit is MAX_DEPTH, counted by the evaluator."""
    from rlmega.agents.tools import MAX_DEPTH

    before = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        assert calculate("-" * (MAX_DEPTH - 1) + "1") == "-1"
        with pytest.raises(ToolError, match="expression too deep"):
            calculate("-" * MAX_DEPTH + "1")
        with pytest.raises(ToolError, match="expression too deep"):
            # deep through binary operators too (left-nested)
            calculate("+".join(["1"] * (MAX_DEPTH + 1)))
    finally:
        sys.setrecursionlimit(before)


def test_calculator_tool_error_type():
    with pytest.raises(ToolError, match="division by zero"):
        calculate("1/0")


def test_format_number():
    assert format_number(5) == "5" and format_number(-12.0) == "-12" and format_number(0.5) == "0.5"
    assert format_number(1 / 3) == "0.333333" and format_number(123.456789) == "123.457"
    assert format_number(1e15) == "1e+15" and format_number(0.000123456789) == "0.000123457"
    assert format_number(float("inf")) == "inf" and format_number(float("nan")) == "nan"


# ---------------------------------------------------------------------------- python


@pytest.mark.parametrize(
    "source,expected",
    [
        ("1+2", "3"),
        ("sum(range(10))", "45"),
        ("2**100", str(2**100)),
        ("1/4", "0.25"),
        ("'abc'.upper()", "'ABC'"),
        ("'a:b'.split(':')", "('a', 'b')"),
        ("[i*i for i in range(5)]", "(0, 1, 4, 9, 16)"),
        ("(1,)", "(1,)"),
        ("()", "()"),
        ("{1: 'x', 2: (3, 4)}", "(1: 'x', 2: (3, 4))"),
        ("set()", "set()"),
        ("{3}", "(3)"),
        ("1 < 2", "true"),
        ("not 1", "false"),
        ("None", "none"),
        ("math.sqrt(16)", "4.0"),
        ("math.factorial(20)", "2432902008176640000"),
        ("sorted((3, 1, 2), reverse=True)", "(3, 2, 1)"),
        ("divmod(17, 5)", "(3, 2)"),
        ("max(len(w) for w in 'a bb ccc'.split())", "3"),
        ("'_' '_import_' '_'", "'__import__'"),  # a dunder name built at run time is just a string
        ("(f := lambda n: 1 if n < 2 else n * f(n - 1))(10)", "3628800"),
        ("  7 * 6  ", "42"),
    ],
)
def test_python_values(source, expected):
    assert run_python(source) == expected


def test_python_output_is_bounded_and_self_reference_is_cut():
    out = run_python("list(range(10**6))")
    assert (
        out.startswith("(0, 1, 2, ")
        and out.endswith(" ...")
        and len(out) <= python_sandbox.MAX_OUTPUT_CHARS + 4
    )
    assert run_python("(l := [1], l.append(l), l)[2]").count("...") == 1


@pytest.mark.parametrize(
    "source,expected",
    [
        ("1/0", "error: zerodivisionerror: division by zero"),
        ("open('/etc/passwd')", "error: nameerror: name 'open' is not defined"),
        ("getattr(1, 'real')", "error: nameerror: name 'getattr' is not defined"),
        ("exec('1')", "error: nameerror: name 'exec' is not defined"),
        ("__import__('os').system('true')", "error: forbidden: double underscores are not allowed"),
        ("().__class__.__bases__", "error: forbidden: double underscores are not allowed"),
        ("import os", "error: syntaxerror: invalid syntax"),
        ("x = 1", "error: syntaxerror: invalid syntax"),
        ("int('x')", "error: valueerror: invalid literal for int() with base 10: 'x'"),
        ("[1][5]", "error: indexerror: list index out of range"),
        # Without the attribute check this returns the sandbox module's globals (real builtins included):
        # a running generator's frame leads back through f_back.
        (
            "(g := (g.gi_frame.f_back.f_back.f_globals for _ in (1,)), list(g))[1][0]",
            "error: forbidden: attribute f globals is not allowed",
        ),
        (
            "(g := (g.gi_frame for _ in (1,)), list(g))",
            "error: forbidden: attribute gi frame is not allowed",
        ),
        ("math.sin.f_globals", "error: forbidden: attribute f globals is not allowed"),
        ("'{0}'.format(1)", "error: forbidden: attribute format is not allowed"),
        ("x" * 2001, "error: forbidden: expression longer than 2000 characters"),
    ],
)
def test_python_errors(source, expected):
    assert run_python(source) == expected


def test_python_timeout_kills_the_process():
    for source in ("sum(range(10**12))", "pow(9, 9**9)", "max(i * i for i in range(10**12))"):
        started = time.monotonic()
        assert run_python(source, timeout_s=0.5, memory_mb=256) == "error: timeout after 0.5 s"
        assert time.monotonic() - started < 1.5


@pytest.mark.parametrize(
    "source", ["[0]*10**10", "'x'*10**10", "[0]*10**8", "'x'*10**9", "list(range(10**9))"]
)
def test_python_memory_limit_holds(source):
    # [0]*10**8 (800 MB) and 'x'*10**9 would succeed on this machine without the limit.
    started = time.monotonic()
    assert run_python(source, timeout_s=2.0, memory_mb=128) == "error: memoryerror: out of memory"
    assert time.monotonic() - started < 2.5


def test_python_memory_filled_gradually_still_answers():
    out = run_python("[i for i in range(10**8)]", timeout_s=3.0, memory_mb=64)
    assert out in ("error: memoryerror: out of memory", "error: timeout after 3 s")


def test_sandbox_check_and_render_in_process():
    assert python_sandbox.check_source("math.pi + abs(-1)") is None
    assert python_sandbox.check_source("__import__") == (
        "forbidden",
        "double underscores are not allowed",
    )
    assert python_sandbox.check_source("(1") == ("syntaxerror", "'(' was never closed")
    assert (
        python_sandbox.render([True, None, (1,), {"a": frozenset()}])
        == "(true, none, (1,), ('a': set()))"
    )
    assert python_sandbox.render("x" * 50, max_chars=10) == "'xxxxxxxxx ..."
    assert (
        "open" not in python_sandbox.SAFE_BUILTINS
        and "gi_frame" not in python_sandbox.ALLOWED_ATTRIBUTES
    )


# ---------------------------------------------------------------------------- registry and run_call


def test_registry():
    assert TOOL_NAMES == ("calculator", "python", "zoom") and set(TOOLS) == set(TOOL_NAMES)
    assert isinstance(get_tool("calculator"), Calculator) and isinstance(
        get_tool("python"), PythonTool
    )
    with pytest.raises(KeyError, match="known tools: calculator, python, zoom"):
        get_tool("search")
    for tool in TOOLS.values():
        assert isinstance(tool, Tool) and set(tool.description) <= VOCAB_CHARACTERS
        assert tool.description.startswith(tool.name + ":")


def test_run_never_raises():
    class Broken(Tool):
        name = "broken"

        def evaluate(self, args, timeout_s, memory_mb):
            raise RuntimeError("Kaboom [internal]")

    assert Broken().run("x") == "error: runtimeerror: kaboom (internal)"


def test_run_call():
    assert run_call(parse_call("<tool>calculator:6*7</tool>")) == "42"
    assert run_call(parse_call("<tool>python:6*7</tool>"), allowed=["python"]) == "42"
    assert run_call(parse_call("<tool>6*7</tool>")) == "error: malformed tool call"
    assert run_call(parse_call("<tool>search:x</tool>")) == (
        "error: unknown tool search; tools: calculator, python, zoom"
    )
    assert run_call(parse_call("<tool>python:1</tool>"), allowed=["calculator", "nope"]) == (
        "error: unknown tool python; tools: calculator"
    )


# ---------------------------------------------------------------------------- vocabulary

TYPICAL_CALCULATOR = [
    "1+2",
    "12*(3+4)",
    "1/3",
    "2**0.5",
    "7//2",
    "1e-9",
    "1e30",
    "-5/4",
    "1/0",
    "9**9**9",
    "(2**90)**90",
    "(-1)**0.5",
    "1e999",
    "abs(1)",
    "x",
    "1+",
    "",
    "'a'",
    "2**-3",
]
TYPICAL_PYTHON = [
    "1+2",
    "1/3",
    "sum(range(100))",
    "[i*i for i in range(5)]",
    "(1, 'a', None, True)",
    "{1: 2}",
    "{1, 2}",
    "math.pi",
    "math.sqrt(-1)",
    "1/0",
    "int('12a')",
    "open('f')",
    "__import__('os')",
    "import os",
    "[1][2]",
    "len(5)",
    "'ab' + 1",
    "sorted([3, 1])",
    "sum(range(10**12))",
    "[0]*10**10",
    "x.gi_frame",
    "(1",
    "divmod(7, 2)",
    "round(2.5)",
]


def test_outputs_encode_losslessly_with_the_tiny_tokenizer():
    from rlmega.demo.tiny_model import make_tokenizer

    tok = make_tokenizer()
    with ThreadPoolExecutor(4) as pool:  # the python tool's calls are processes: overlap them
        python_outputs = list(pool.map(lambda s: run_python(s, timeout_s=0.5), TYPICAL_PYTHON))
    outputs = [calculate_or_error(e) for e in TYPICAL_CALCULATOR] + python_outputs
    assert any(o.startswith("error: timeout") for o in python_outputs)
    assert any(o.startswith("error: memoryerror") for o in python_outputs)
    for out in outputs:
        for text in (out, format_result(out), format_call("python", "1+2") + format_result(out)):
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text, text
        assert set(out) <= VOCAB_CHARACTERS, out


def calculate_or_error(expression: str) -> str:
    return get_tool("calculator").run(expression)


def _png(size, colour=(200, 0, 0)) -> bytes:
    import io

    from PIL import Image

    img = Image.new("RGB", size, (255, 255, 255))
    img.paste(colour, (0, 0, size[0] // 2, size[1] // 2))  # the top-left quarter coloured
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_zoom_answers_with_the_box_enlarged():
    import io

    from PIL import Image

    from rlmega.agents.tools import ImageResult

    images = [_png((80, 40)), _png((30, 60), colour=(0, 0, 200))]
    out = run_call(parse_call("<tool>zoom:0 0 50 50</tool>"), images=images)
    assert isinstance(out, ImageResult)
    img = Image.open(io.BytesIO(out.png))
    assert img.size == (80, 40)  # the 40x20 quarter, doubled: never past the image's own size
    assert img.getpixel((40, 20)) == (200, 0, 0)  # all of it the coloured quarter
    second = Image.open(
        io.BytesIO(run_call(parse_call("<tool>zoom:2, 0 0 100 50</tool>"), images=images).png)
    )
    # image 2, its top half
    assert second.size == (30, 30) and second.getpixel((5, 5)) == (0, 0, 200)
    thin = Image.open(
        io.BytesIO(run_call(parse_call("<tool>zoom:99 0 100 1</tool>"), images=images).png)
    )
    # a box under one pixel wide is one pixel, enlarged until a side meets the image's
    assert thin.size == (40, 40)


@pytest.mark.parametrize(
    "args, error",
    [
        ("25 25 75", "give left top right bottom as whole percents"),
        ("25 25 75 75 1 2", "give left top right bottom as whole percents"),
        ("-1 0 50 50", "give left top right bottom as whole percents"),
        ("1.5 0 50 50", "give left top right bottom as whole percents"),
        ("50 0 25 50", "need 0 <= left < right <= 100"),
        ("0 0 50 500", "need 0 <= left < right <= 100"),
        ("0 0 0 0 0", "images are numbered from 1"),
        ("3 0 0 50 50", "this prompt has 2 image(s)"),
        ("1" * 70, "box too long"),
    ],
)
def test_zoom_refuses_what_the_model_wrote_wrong(args, error):
    out = run_call(parse_call(f"<tool>zoom:{args}</tool>"), images=[_png((8, 8)), _png((8, 8))])
    assert out.startswith("error: ") and error in out, out


def test_zoom_without_an_image():
    assert run_call(parse_call("<tool>zoom:0 0 50 50</tool>")) == "error: this prompt has no image"

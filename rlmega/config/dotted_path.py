"""Import a function named by a dotted path or by a file: the one extension mechanism of rlmega configs.

    fn = resolve("rlmega.rewards.arithmetic.score")      # the config's reward.fn: an installed module
    fn = resolve("/home/me/rl/my_reward.py:score")       # a file of one's own (TRL/verl users expect this)

Dotted: the longest importable prefix is the module; the rest is an attribute chain, so a path may also
name a class attribute ("pkg.mod.Class.method"). File: ``PATH.py:ATTR[.ATTR]``; the file is run as a module
of its own (named ``rlmega_file_<stem>_<hash of its path>``, kept in sys.modules so that the same path
gives the same function, and pickle finds what it defines); it may import installed packages, not its
folder's other files (make the folder a package for that). A relative path is taken from the current
directory; the config makes it absolute when it loads (:func:`absolute`), so that Ray's workers, which
run elsewhere, open the same file. Each failure names the path and what went wrong.

It sits in rlmega.config because a config's dotted paths (reward.fn, a judger's fn) are checked when the
config loads; rlmega.rewards re-exports resolve and RewardResolveError.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Callable

FILE_MARK = ".py:"  # "path/to/file.py:function"


class RewardResolveError(ValueError):
    """A dotted path that does not lead to a callable; ``what`` went wrong and the ``fix``."""

    def __init__(self, message: str, what: str = "", fix: str = ""):
        super().__init__(message)
        self.what, self.fix = what, fix


def _missing_module(e: ModuleNotFoundError, module: str) -> bool:
    """True when `module` itself (or a parent package) is absent, not something it imports."""
    return e.name is not None and (module == e.name or module.startswith(e.name + "."))


def is_file_path(spec) -> bool:
    """True for ``path/to/file.py:function``, False for a dotted path."""
    return isinstance(spec, str) and FILE_MARK in spec


def absolute(spec: str) -> str:
    """``spec`` with its file made absolute (from the current directory); a dotted path as it is."""
    if not is_file_path(spec):
        return spec
    path, attr = spec.rsplit(":", 1)
    return f"{os.path.abspath(os.path.expanduser(path))}:{attr}"


def shape_problem(spec: str) -> str | None:
    """What is wrong with ``spec``'s shape ("is not a dotted path"), without importing; None when it is
    package.module.function or path/to/file.py:function."""
    if is_file_path(spec):
        path, attr = spec.rsplit(":", 1)
        if (
            not path.endswith(".py")
            or not path[:-3]
            or not all(p.isidentifier() for p in attr.split("."))
        ):
            return "is not path/to/file.py:function"
        return None
    parts = spec.split(".") if isinstance(spec, str) else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return "is not a dotted path"
    return None


SHAPE_FIX = (
    "write it as package.module.function (e.g. rlmega.rewards.arithmetic.score), or as "
    "path/to/file.py:function for a file of your own"
)


def _file_module(path: str, fail: Callable[[str, str], RewardResolveError]):
    """The module the file at ``path`` defines, run once per process (its sys.modules entry after)."""
    where = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(where):
        shown = where if where == path else f"{path} (from {os.getcwd()}: {where})"
        raise fail(
            f"no file {shown}",
            "give the path of the Python file that defines the function; a relative path "
            "is taken from the directory rlmega runs in",
        )
    stem = os.path.splitext(os.path.basename(where))[0]
    name = (
        f"rlmega_file_{''.join(c if c.isalnum() else '_' for c in stem)}_"
        f"{hashlib.sha256(where.encode()).hexdigest()[:10]}"
    )
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickle look a module up by name
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        del sys.modules[name]
        raise fail(
            f"running {where} failed: {e}",
            f"install the missing package {e.name!r}, or fix the import in "
            f"{where} (a file of one's own imports installed packages, not the other files of its folder)",
        ) from e
    except Exception as e:
        del sys.modules[name]
        raise fail(
            f"running {where} failed: {type(e).__name__}: {e}", f"fix the error in {where}"
        ) from e
    return module


def _not_found_fix(module: str, attr: str = "function") -> str:
    """The fix for a dotted path whose module does not import: a file of one's own is the common case."""
    here = os.path.join(os.getcwd(), *module.split(".")) + ".py"
    if os.path.isfile(here):
        return (
            f"{here} is a file, not an installed module: name it as a file, "
            f"{os.path.relpath(here)}:{attr} (path/to/file.py:function)"
        )
    return (
        "for a file of your own, write path/to/file.py:function; for a package, check the spelling, and that it "
        "is installed in this environment"
    )


def resolve(dotted_path: str, field: str = "reward.fn") -> Callable:
    """The callable at `dotted_path` ("package.module.function", or "path/to/file.py:function");
    RewardResolveError otherwise."""

    def fail(what: str, fix: str) -> RewardResolveError:
        return RewardResolveError(
            f"{field}={dotted_path!r}: {what}. Fix: {fix}", f"{dotted_path!r}: {what}", fix
        )

    shape = shape_problem(dotted_path)
    if shape:
        raise fail(shape, SHAPE_FIX)
    if is_file_path(dotted_path):
        path, attrs = dotted_path.rsplit(":", 1)
        module = _file_module(path, fail)
        return _attribute_chain(module, module, attrs.split("."), path, None, fail)
    parts = dotted_path.split(".")

    module = obj = None
    first_missing = None
    for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix
        name = ".".join(parts[:i])
        try:
            obj = module = importlib.import_module(name)
            break
        except ModuleNotFoundError as e:
            if not _missing_module(e, name):
                raise fail(
                    f"importing module {name!r} failed: {e}",
                    f"install the missing package {e.name!r} or fix the import in {name}",
                ) from e
            first_missing = first_missing or e
        except Exception as e:  # the module exists but raised while importing
            raise fail(
                f"importing module {name!r} failed: {type(e).__name__}: {e}",
                f"fix the error in {name}",
            ) from e
    if module is None:
        name = ".".join(parts[:-1])
        raise fail(
            f"module {name!r} not found ({first_missing})", _not_found_fix(name, parts[-1])
        ) from first_missing
    return _attribute_chain(module, obj, parts[i:], module.__name__, first_missing, fail)


def _attribute_chain(
    module,
    obj,
    attrs: list[str],
    done: str,
    first_missing: ModuleNotFoundError | None,
    fail: Callable[[str, str], RewardResolveError],
) -> Callable:
    """``obj.attrs[0].attrs[1]...``, which must be callable; ``done`` names ``obj`` in the errors."""
    for attr in attrs:
        sep = ":" if done.endswith(".py") else "."  # a file's first attribute follows its colon
        if not hasattr(obj, attr):
            if obj is module and first_missing is not None:
                # "pkg.missing_mod.fn": the longer prefix was the intended module, not an attribute of pkg.
                raise fail(
                    f"module {first_missing.name!r} not found", _not_found_fix(first_missing.name)
                ) from first_missing
            public = [a for a in dir(obj) if not a.startswith("_")]
            close = difflib.get_close_matches(attr, public, n=3)
            if close:
                hint = "did you mean " + " or ".join(f"{done}{sep}{c}" for c in close) + "?"
            else:
                names = [a for a in public if callable(getattr(obj, a, None))]
                hint = (
                    f"{done} defines the callables: {', '.join(names)[:300]}"
                    if names
                    else f"{done} defines no public callables; name a module that does"
                )
            raise fail(f"{done!r} has no attribute {attr!r}", hint)
        obj = getattr(obj, attr)
        done = f"{done}{sep}{attr}"
    if not callable(obj):
        raise fail(
            f"{done!r} is a {type(obj).__name__}, not a callable",
            "point it at a function fn(response_text, label, **kwargs) -> float",
        )
    return obj

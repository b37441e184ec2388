"""Import a function named by a dotted path: the one extension mechanism of rlmega configs.

    fn = resolve("rlmega.rewards.arithmetic.score")      # the config's reward.fn

The longest importable prefix is the module; the rest is an attribute chain, so a path may also
name a class attribute ("pkg.mod.Class.method"). Each failure names the path and what went wrong.

It sits in rlmega.config because a config's dotted paths (reward.fn, a judger's fn) are checked when the
config loads; rlmega.rewards re-exports resolve and RewardResolveError.
"""
from __future__ import annotations

import difflib
import importlib
from typing import Callable


class RewardResolveError(ValueError):
    """A dotted path that does not lead to a callable; ``what`` went wrong and the ``fix``."""

    def __init__(self, message: str, what: str = "", fix: str = ""):
        super().__init__(message)
        self.what, self.fix = what, fix


def _missing_module(e: ModuleNotFoundError, module: str) -> bool:
    """True when `module` itself (or a parent package) is absent, not something it imports."""
    return e.name is not None and (module == e.name or module.startswith(e.name + "."))


def resolve(dotted_path: str, field: str = "reward.fn") -> Callable:
    """The callable at `dotted_path` ("package.module.function"); RewardResolveError otherwise."""
    def fail(what: str, fix: str) -> RewardResolveError:
        return RewardResolveError(f"{field}={dotted_path!r}: {what}. Fix: {fix}", f"{dotted_path!r}: {what}", fix)

    parts = dotted_path.split(".") if isinstance(dotted_path, str) else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise fail("is not a dotted path", "write it as package.module.function, e.g. rlmega.rewards.arithmetic.score")

    module = obj = None
    first_missing = None
    for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix
        name = ".".join(parts[:i])
        try:
            obj = module = importlib.import_module(name)
            break
        except ModuleNotFoundError as e:
            if not _missing_module(e, name):
                raise fail(f"importing module {name!r} failed: {e}",
                           f"install the missing package {e.name!r} or fix the import in {name}") from e
            first_missing = first_missing or e
        except Exception as e:  # the module exists but raised while importing
            raise fail(f"importing module {name!r} failed: {type(e).__name__}: {e}",
                       f"fix the error in {name}") from e
    if module is None:
        name = ".".join(parts[:-1])
        raise fail(f"module {name!r} not found ({first_missing})",
                   "check the spelling, and that the package is installed in this environment") from first_missing

    done = module.__name__
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            if obj is module and first_missing is not None:
                # "pkg.missing_mod.fn": the longer prefix was the intended module, not an attribute of pkg.
                raise fail(f"module {first_missing.name!r} not found",
                           "check the spelling, and that the package is installed in this environment"
                           ) from first_missing
            public = [a for a in dir(obj) if not a.startswith("_")]
            close = difflib.get_close_matches(attr, public, n=3)
            if close:
                hint = "did you mean " + " or ".join(f"{done}.{c}" for c in close) + "?"
            else:
                names = [a for a in public if callable(getattr(obj, a, None))]
                hint = f"{done} defines the callables: {', '.join(names)[:300]}" if names else \
                    f"{done} defines no public callables; name a module that does"
            raise fail(f"{done!r} has no attribute {attr!r}", hint)
        obj = getattr(obj, attr)
        done = f"{done}.{attr}"
    if not callable(obj):
        raise fail(f"{done!r} is a {type(obj).__name__}, not a callable",
                   "point it at a function fn(response_text, label, **kwargs) -> float")
    return obj

"""Single-field ranges, declared beside their fields in schema.py (issue 58: checks beside their fields).

    seed: int = ranged(0, SEED)                     # in schema.py: the default and its range
    for path, value, rule in ranged_fields(cfg):    # in validate.py: every ranged field of every section
        if not rule.ok(value): ...                  # "rollout.top_p: 1.5 must be in (0, 1]"

A section that sits in several places (an OptimizerConfig is the actor's and the critic's) is checked wherever
it sits, under its own path. docs/configuration.md shows each field's rule in the same words (rlmega/config/docs.py).
Rules that tie fields together live in validate.py and the *_rules.py files.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

# Seeds: numpy's np.random.seed takes < 2**32 (model.seed reaches it on every rank), and offsets are
# added to the seeds (rank, engine, step x 1_000_003, epoch); 2**31 - 1 leaves them room and fits int32.
SEED_MAX = 2**31 - 1
MAX_SYNTHETIC = 10**6  # the synthetic problems are made and tokenized in the driver at start-up


@dataclasses.dataclass(frozen=True)
class Range:
    """What one field's value may be: ``ok(value)``, and the rule in the words errors and docs use."""

    ok: Callable[[Any], bool]
    words: str

    def noted(self, note: str) -> Range:
        """The same rule, its words followed by why: ``GE1.noted("0 is produce.strategy=sync")``."""
        return Range(self.ok, f"{self.words} ({note})")


def or_null(rule: Range, meaning: str = "") -> Range:
    """``rule``, or null (which means ``meaning``)."""
    return Range(
        lambda v: v is None or rule.ok(v),
        f"null{f' ({meaning})' if meaning else ''} or {rule.words}",
    )


def upto(hi: int, lo: int = 1) -> Range:
    return Range(lambda v: lo <= v <= hi, f"in [{lo}, {hi}]")


GE0 = Range(lambda v: v >= 0, ">= 0")
GE1 = Range(lambda v: v >= 1, ">= 1")
GT0 = Range(lambda v: v > 0, "> 0")
UNIT = Range(lambda v: 0 <= v < 1, "in [0, 1)")
FRACTION = Range(lambda v: 0 < v <= 1, "in (0, 1]")
PROPORTION = Range(lambda v: 0 <= v <= 1, "in [0, 1]")
NONE_OR_GE1 = or_null(GE1, "automatic")
SEED = Range(lambda v: 0 <= v <= SEED_MAX, f"in [0, {SEED_MAX}] (2**31 - 1)")


def ranged(default: Any = dataclasses.MISSING, rule: Range | None = None, **field_kwargs) -> Any:
    """A dataclass field with its range: ``ranged(1, GE1)``; other arguments go to dataclasses.field."""
    return dataclasses.field(default=default, metadata={"range": rule}, **field_kwargs)


def range_of(f: dataclasses.Field) -> Range | None:
    return f.metadata.get("range")


def ranged_fields(section: Any, prefix: str = "") -> Iterator[tuple[str, Any, Range]]:
    """(dotted path, value, rule) of every ranged field in ``section`` and the sections inside it (a section
    left null is skipped; lists, such as tasks, are checked by their own rules)."""
    for f in dataclasses.fields(section):
        value, path = getattr(section, f.name), f"{prefix}{f.name}"
        rule = range_of(f)
        if rule is not None:
            yield path, value, rule
        elif dataclasses.is_dataclass(value):
            yield from ranged_fields(value, path + ".")

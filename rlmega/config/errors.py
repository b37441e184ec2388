"""The error every load-time check raises, the one format of its lines, and the counts every check bounds
(no imports: any check may use them)."""

from __future__ import annotations

from typing import List


class ConfigError(ValueError):
    """An invalid config; `problems` holds one `field: problem. Fix: ...` line per problem."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(
            f"invalid config ({n} problem{'s' if n != 1 else ''}):\n  " + "\n  ".join(self.problems)
        )


def problem(field: str, what: str, fix: str) -> str:
    return f"{field}: {what}. Fix: {fix}"


# Counts past which a run is a typo, not a plan (each engine, actor or sample costs memory and a process).
MAX_ACTORS = 4096

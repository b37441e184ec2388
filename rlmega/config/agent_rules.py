"""The agent loop's tools as a config names them: the names agent_loop.tools may hold and the bounds of a
tool call's limits (agent_loop.tool_timeout_s, tool_memory_mb).

Rules of config values, checked when a config loads (rlmega/config/task_rules.py); the tools themselves
(rlmega/agents/tools.py, whose TOOLS registry holds exactly these names) import them from here and refuse
a call outside the same bounds. No imports: any module may read them.
"""

from __future__ import annotations

TOOL_NAMES: tuple[str, ...] = ("calculator", "python", "zoom")
IMAGE_TOOLS: tuple[str, ...] = ("zoom",)  # they answer with images: a vision-language model only

# Bounds on a call's limits: a tool call holds up its trajectory, and an address-space limit near
# the machine's memory is no limit. The tools refuse a call outside them (rlmega.agents.tools.limit_problem),
# the config's validation a config (task_rules.agent_loop_problems).
MAX_TIMEOUT_S = 600.0
MIN_MEMORY_MB, MAX_MEMORY_MB = 16, 65536


def task_loops(cfg) -> list[tuple[str, object]]:
    """(field, agent loop config) of each task: the default task's agent_loop, or each of cfg.tasks'."""
    if not cfg.tasks:
        return [("agent_loop", cfg.agent_loop)]
    return [(f"tasks[{i}].agent_loop", t.agent_loop) for i, t in enumerate(cfg.tasks)]


def observed_images(loop) -> int:
    """The most image observations one engine request of ``loop`` carries besides its prompt's images: one a
    turn after the first, when the loop has a tool that answers with an image."""
    if loop.kind != "tool" or not set(loop.tools) & set(IMAGE_TOOLS):
        return 0
    return max(0, loop.max_turns - 1)

"""Checks of an agent loop's judger list, run when the config loads (called from rlmega/config/task_rules.py).

    problems = validate_judgers(cfg.agent_loop.judgers, "agent_loop.judgers", cfg.reward)
    # ["agent_loop.judgers[1].url: kind http needs a url. Fix: ...", ...]

Each problem names the field (`<prefix>[i].<field>`, or the list itself for whole-list rules) and the
fix, in the style of rlmega.config.validate. Dotted paths are imported (dotted_path.resolve), and a model
judge's folder is looked at (config.json), so a bad judger fails at load, not at the first trajectory.
Nothing heavy is imported: no Ray, vLLM or transformers. They are rules of config values, so they sit in
rlmega.config (rlmega.judgers reads them: factory.py checks a list before building it, model.py checks a
judge's template and sizes its engine).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

from rlmega.config.dotted_path import RewardResolveError, resolve
from rlmega.config.errors import MAX_ACTORS, problem
from rlmega.config.finite import finite_number
from rlmega.config.schema import JUDGER_KINDS, JudgerConfig, RewardConfig


def check_template(template: str) -> None:
    """ValueError when `template` names a field other than prompt, response and label, or is malformed."""
    if not isinstance(template, str):
        raise ValueError(f"prompt_template {template!r} is not a string")
    try:
        template.format(prompt="", response="", label="")
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise ValueError(
            f"prompt_template {template!r} does not format with prompt, response and label "
            f"({type(e).__name__}: {e})"
        ) from None


# What a reward function may name beyond (response_text, label, **kwargs) to get more of the item, opt-in by
# name (rlmega/judgers/native.py passes them): the prompt's text, the loop's metadata, the prompt's images,
# the response with its special tokens, the token ids, the row's other columns (a dict; each column also
# comes by its own name to a function that names it).
ITEM_PARAMETERS = (
    "prompt",
    "metadata",
    "images",
    "response_raw",
    "response_ids",
    "prompt_ids",
    "columns",
)


def signature_problem(fn, kwargs: dict) -> str | None:
    """Why ``fn`` cannot be called as a reward function ``fn(response_text, label, **kwargs)`` (the
    contract of rlmega/judgers/native.py), or None. A callable with no inspectable signature (most C
    builtins) is refused: nothing says it takes those arguments. os.system, say, takes one. A C builtin
    is refused even with a signature that fits (print(*args) binds anything): none returns a score."""
    if inspect.isbuiltin(fn):
        return f"{getattr(fn, '__qualname__', fn)!r} is a builtin, not a reward function"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return f"{getattr(fn, '__qualname__', fn)!r} has no inspectable signature (a builtin?)"
    try:
        # past the first two, a parameter may be an item field or a column of the rows (checked when called:
        # check-config calls the function on a row, rlmega/judgers/first_row.py)
        later = [
            p.name
            for p in list(sig.parameters.values())[2:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
        ]
        sig.bind("response", "label", **kwargs, **{p: None for p in later if p not in kwargs})
    except TypeError as e:
        shown = f" with keyword arguments {sorted(kwargs)}" if kwargs else ""
        return f"{getattr(fn, '__qualname__', fn)}{sig} cannot be called as fn(response_text, label){shown}: {e}"
    return None


SIGNATURE_FIX = "point it at a function fn(response_text, label, **kwargs) -> float (see rlmega/rewards/arithmetic.py)"


def _check_one(c: JudgerConfig, f: str, reward_cfg: RewardConfig) -> list[str]:
    out = []
    if c.kind not in JUDGER_KINDS:
        out.append(
            problem(
                f"{f}.kind", f"unknown kind {c.kind!r}", f"choose one of {', '.join(JUDGER_KINDS)}"
            )
        )
    if not isinstance(c.name, str) or not c.name or "/" in c.name:
        out.append(
            problem(
                f"{f}.name",
                f"{c.name!r} is not a usable name",
                "give a non-empty name without '/' (scores are named <judger>/<score>)",
            )
        )
    if not (finite_number(c.timeout_s) and c.timeout_s > 0):
        out.append(
            problem(
                f"{f}.timeout_s",
                f"{c.timeout_s!r} is not > 0",
                "give the seconds one trajectory's judging may take, e.g. 60",
            )
        )
    if not (finite_number(c.weight) and c.weight >= 0):
        out.append(
            problem(
                f"{f}.weight",
                f"{c.weight!r} is not a number >= 0",
                "give a weight >= 0 (0 computes and logs the score without rewarding it)",
            )
        )
    if not isinstance(c.kwargs, dict):
        out.append(
            problem(
                f"{f}.kwargs",
                f"{c.kwargs!r} is not a mapping",
                "give keyword arguments as a mapping",
            )
        )

    if c.kind in ("native", "ray"):
        fn = c.fn or reward_cfg.fn
        via = "" if c.fn else f" (fn is empty, so reward.fn={reward_cfg.fn!r} is used)"
        try:
            resolved = resolve(fn, field=f"{f}.fn")
        except RewardResolveError as e:
            out.append(problem(f"{f}.fn", e.what + via, e.fix))
        else:
            why = signature_problem(resolved, c.kwargs if isinstance(c.kwargs, dict) else {})
            if why:
                out.append(problem(f"{f}.fn", why + via, SIGNATURE_FIX))
    if c.kind == "ray":
        # On use: rlmega.config.validate reaches this module (through task_rules) while it checks a config.

        if not (isinstance(c.num_actors, int) and 1 <= c.num_actors <= MAX_ACTORS):
            many = isinstance(c.num_actors, int) and c.num_actors > MAX_ACTORS
            out.append(
                problem(
                    f"{f}.num_actors",
                    f"{c.num_actors} is more than {MAX_ACTORS}"
                    if many
                    else f"{c.num_actors!r} is not >= 1",
                    f"give 1 to {MAX_ACTORS} actors, or kind native to judge in the agent loop's process",
                )
            )
    if c.kind in ("ray", "model"):
        if not (finite_number(c.cpus_per_actor) and c.cpus_per_actor >= 0):
            out.append(
                problem(
                    f"{f}.cpus_per_actor",
                    f"{c.cpus_per_actor!r} is not >= 0",
                    "give the Ray CPUs each actor reserves, e.g. 0.25",
                )
            )
        if not (isinstance(c.memory_mb_per_actor, int) and c.memory_mb_per_actor >= 0):
            out.append(
                problem(
                    f"{f}.memory_mb_per_actor",
                    f"{c.memory_mb_per_actor!r} is not an integer >= 0",
                    "give MiB per actor, or 0 to reserve none",
                )
            )
    if c.kind == "http":
        if not c.url:
            out.append(
                problem(
                    f"{f}.url",
                    "kind http needs a url",
                    "give the service's endpoint, e.g. http://judge:8000/score",
                )
            )
        elif not str(c.url).startswith(("http://", "https://")):
            out.append(
                problem(
                    f"{f}.url",
                    f"{c.url!r} is not an http(s) URL",
                    "start it with http:// or https://",
                )
            )
    if c.kind == "model":
        if not c.model_path:
            out.append(
                problem(
                    f"{f}.model_path",
                    "kind model needs a model_path",
                    "give the judge model's Hugging Face folder",
                )
            )
        elif not os.path.isfile(os.path.join(c.model_path, "config.json")):
            out.append(
                problem(
                    f"{f}.model_path",
                    f"no config.json in {c.model_path!r}",
                    "point it at a Hugging Face model folder (one with config.json)",
                )
            )
        try:
            check_template(c.prompt_template)
        except ValueError as e:
            out.append(
                problem(
                    f"{f}.prompt_template",
                    str(e),
                    "use only {prompt}, {response} and {label}; write a literal brace as {{ or }}",
                )
            )
        if not (isinstance(c.max_tokens, int) and c.max_tokens >= 1):
            out.append(
                problem(
                    f"{f}.max_tokens",
                    f"{c.max_tokens!r} is not >= 1",
                    "give the tokens the judge may generate, e.g. 4",
                )
            )
        out += _engine_problems(c, f)
    return out


# Beyond any model's context; keeps a typo (4096000) from sizing an engine.
MAX_JUDGE_MODEL_LEN = 1 << 20


def _engine_problems(c: JudgerConfig, f: str) -> list[str]:
    """A model judge's engine settings (rlmega.judgers.model.engine_settings)."""
    out = []
    if c.device not in (None, "cpu", "cuda"):
        out.append(
            problem(
                f"{f}.device",
                f"{c.device!r} is not a device",
                "choose cpu or cuda, or null (rollout.device)",
            )
        )
    tokens = c.max_tokens if isinstance(c.max_tokens, int) else 1
    if c.max_model_len is None:
        pass  # the judge model's own context, capped (rlmega.judgers.model.engine_settings)
    elif not (
        isinstance(c.max_model_len, int)
        and not isinstance(c.max_model_len, bool)
        and tokens < c.max_model_len <= MAX_JUDGE_MODEL_LEN
    ):
        out.append(
            problem(
                f"{f}.max_model_len",
                f"{c.max_model_len!r} is not in (max_tokens={tokens}, {MAX_JUDGE_MODEL_LEN}]",
                "give the judge engine's context in tokens (judge prompt + "
                "max_tokens), e.g. 4096, or null for the judge model's own",
            )
        )
    else:
        limit = max_positions(c.model_path)
        if limit is not None and c.max_model_len > limit:
            out.append(
                problem(
                    f"{f}.max_model_len",
                    f"{c.max_model_len} is more than the judge model's "
                    f"max_position_embeddings={limit}",
                    f"set it to at most {limit}, or null",
                )
            )
    if not (finite_number(c.gpu_memory_utilization) and 0 < c.gpu_memory_utilization <= 1):
        out.append(
            problem(
                f"{f}.gpu_memory_utilization",
                f"{c.gpu_memory_utilization!r} is not in (0, 1]",
                "give the share of its GPU the judge engine may use, e.g. 0.3",
            )
        )
    if not (finite_number(c.kv_cache_space_gb) and 0 < c.kv_cache_space_gb <= 1024):
        out.append(
            problem(
                f"{f}.kv_cache_space_gb",
                f"{c.kv_cache_space_gb!r} is not in (0, 1024]",
                "give GiB of host memory for the judge engine's KV cache, e.g. 1",
            )
        )
    return out


def max_positions(model_path: str) -> int | None:
    """The judge model's max_position_embeddings from its config.json; None when unknown."""
    import json

    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
            value = json.load(fh).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None  # a missing or broken config.json is model_path's own problem
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def validate_judgers(
    cfgs: Sequence[JudgerConfig], field_prefix: str, reward_cfg: RewardConfig
) -> list[str]:
    """One `field: problem. Fix: ...` line per problem of the judger list at `field_prefix`
    (e.g. "agent_loop.judgers" or "tasks[0].agent_loop.judgers"); [] when it is fine or empty (an
    empty list means one judger from the reward section, checked with that section)."""
    out: list[str] = []
    seen: dict[str, int] = {}
    for i, c in enumerate(cfgs):
        f = f"{field_prefix}[{i}]"
        out += _check_one(c, f, reward_cfg)
        if c.name in seen:
            out.append(
                problem(
                    f"{f}.name",
                    f"duplicate name {c.name!r} (also {field_prefix}[{seen[c.name]}])",
                    "give each judger of a loop its own name: it names its score",
                )
            )
        else:
            seen[c.name] = i
    weights = [c.weight for c in cfgs]
    if cfgs and all(finite_number(w) and w >= 0 for w in weights) and not sum(weights) > 0:
        out.append(
            problem(
                f"{field_prefix}",
                f"the weights {weights} sum to {sum(weights):g}",
                "give at least one judger a weight > 0 (the reward divides by their sum)",
            )
        )
    return out

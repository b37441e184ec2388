"""Load an RLConfig: schema defaults <- YAML file <- command-line overrides, then validate.

    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.total_steps=10", "rollout.n=8"])

Every failure is a ConfigError naming the field by its dotted path and saying how to fix it.
"""

import dataclasses
import difflib
import os
import typing
from typing import List, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from rlmega.config.schema import RLConfig
from rlmega.config.dotted_path import absolute
from rlmega.config.errors import ConfigError, problem
from rlmega.config.validate import validate


def _field_paths(cls=RLConfig, prefix: str = "") -> List[str]:
    """Every section and field as a dotted path: 'trainer', 'trainer.total_steps', ..."""
    out = []
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        out.append(path)
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            out += _field_paths(hint, path + ".")
    return out


def _field_hint(dotted: str):
    """The annotated type of a dotted field, or None when it is not in the schema."""
    hint = RLConfig
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(hint):
            return None
        hint = typing.get_type_hints(hint).get(part)
    return hint


def _suggest(key: str) -> List[str]:
    """Close matches among the key's siblings ('trainer.total_step'), then fields of that name
    in other sections ('trainer.lr' -> 'optimizer.lr')."""
    parent, _, leaf = key.rpartition(".")
    paths = _field_paths()
    siblings = [p.rpartition(".")[2] for p in paths if p.rpartition(".")[0] == parent]
    close = [
        f"{parent}.{s}" if parent else s
        for s in difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)
    ]
    close += [
        p
        for p in paths
        if difflib.SequenceMatcher(None, leaf, p.rpartition(".")[2]).ratio() >= 0.85
    ]
    return list(dict.fromkeys(close))[:3]


# Fields that existed once and did nothing; a config that still sets one is told what acts instead.
REMOVED = {
    "trainer.micro_batch_size": "micro-batches are packed by tokens: set actor.max_tokens_per_micro_batch "
    "instead, and remove trainer.micro_batch_size",
    "trainer.seed": "prompt order is seeded by data.seed, sampling by rollout.seed and initialisation by "
    "model.seed: set those instead, and remove trainer.seed",
}


def _type_name(hint) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:  # Optional[X]
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _locate(tree, e: OmegaConfBaseException, path: str = "") -> str | None:
    """The full path (e.g. tasks[0].agent_loop.judgers[1].kind) of the value OmegaConf rejected when it
    names only the leaf: the key of that name whose value the message quotes."""
    leaf = (e.full_key or "").rsplit(".", 1)[-1]
    if not leaf or "." in (e.full_key or ""):
        return None
    items = (
        tree.items()
        if isinstance(tree, dict)
        else enumerate(tree)
        if isinstance(tree, list)
        else []
    )
    for k, v in items:
        sub = f"{path}[{k}]" if isinstance(tree, list) else f"{path}.{k}" if path else str(k)
        if k == leaf and not isinstance(v, (dict, list)) and f"'{v}'" in str(e):
            return sub
        found = _locate(v, e, sub)
        if found:
            return found
    return None


def _as_config_error(
    e: OmegaConfBaseException, source: str, where: str | None = None
) -> ConfigError:
    key = where or e.full_key or "<root>"
    what = (str(e.msg or e) or type(e).__name__).splitlines()[0]
    if isinstance(e, ConfigKeyError) and key in REMOVED:
        return ConfigError([problem(key, f"no longer a config field (in {source})", REMOVED[key])])
    if isinstance(e, ConfigKeyError):
        close = _suggest(key)
        fix = (
            f"did you mean {' or '.join(close)}? Otherwise remove it"
            if close
            else "remove it (see rlmega/config/schema.py for the fields)"
        )
        return ConfigError([problem(key, f"unknown key (in {source})", fix)])
    hint = _field_hint(key)
    if typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = (
            inner[0] if len(inner) == 1 and typing.get_origin(inner[0]) is typing.Literal else hint
        )
    if typing.get_origin(hint) is typing.Literal:
        fix = f"use one of: {', '.join(map(str, typing.get_args(hint)))}"
    elif hint is not None:
        fix = f"give {key} a value of type {_type_name(hint)}"
    else:
        fix = "check the value against rlmega/config/schema.py"
    return ConfigError([problem(key, f"{what} (in {source})", fix)])


def _read_yaml(path: str) -> DictConfig:
    if os.path.isdir(path):
        raise ConfigError(
            [
                problem(
                    "config file",
                    f"{path!r} is a folder, not a file",
                    "pass the path of a YAML file in it, e.g. configs/tiny_cpu.yaml",
                )
            ]
        )
    if not os.path.isfile(path):
        raise ConfigError(
            [
                problem(
                    "config file",
                    f"{path!r} does not exist",
                    "pass the path of a YAML file, e.g. configs/tiny_cpu.yaml",
                )
            ]
        )
    try:
        # OmegaConf's loader also reads 1e-5 as a float, unlike plain PyYAML
        node = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(
            [problem("config file", f"{path!r} is not valid YAML: {e}", "fix the YAML syntax")]
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            [
                problem(
                    "config file",
                    f"{path!r} is not UTF-8 text (byte {e.start}: {e.reason})",
                    "save the file as UTF-8",
                )
            ]
        ) from None
    if not isinstance(node, DictConfig):
        raise ConfigError(
            [
                problem(
                    "config file",
                    f"{path!r} holds a {type(node).__name__}, not a mapping",
                    "write sections at the top level, e.g. `trainer: {total_steps: 10}`",
                )
            ]
        )
    return node


def _read_overrides(overrides: Sequence[str]) -> DictConfig:
    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        fix = "write overrides as section.field=value, e.g. trainer.total_steps=10"
        raise ConfigError(
            [problem("override", f"{o!r} is not of the form key=value", fix) for o in bad]
        )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    # a value that is not YAML, e.g. "a.b=[" or "[???]"
    except (OmegaConfBaseException, yaml.YAMLError):
        # Name the override: parse each alone (the first that fails is the culprit).
        for o in overrides:
            try:
                OmegaConf.from_dotlist([o])
            except (OmegaConfBaseException, yaml.YAMLError) as one:
                e = one
                break
        else:
            o = ", ".join(overrides)
        what = str(e).replace("\n", " ")[:200]
        raise ConfigError(
            [
                problem(
                    o.split("=", 1)[0].strip(),
                    f"the override {o!r} is not a YAML value ({what})",
                    "quote the value, or write a list as [a, b] and a mapping as {k: v}",
                )
            ]
        ) from None


_LIST_SECTIONS = {"tasks"}  # top-level keys that hold a list of sections, not one section


def _shape_problems(node, hint, path: str, source: str) -> List[str]:
    """Values (plain containers of one layer) whose kind (mapping, list, scalar) differs from the
    schema's, and ??? left in.

    OmegaConf's merge raises a bare TypeError ("Cannot merge incompatible container types") for a list
    where a mapping belongs (reward.kwargs=[1,2], tasks: {a: 1}), naming nothing; and it merges ???
    (its "missing value") by keeping the default, so `total_steps: ???` would quietly run 2 steps."""
    if node == "???":
        return [
            problem(
                path,
                f"is ??? (OmegaConf's 'missing value') in {source}",
                f"give {path} a value, or remove it to keep the default",
            )
        ]
    if typing.get_origin(hint) is typing.Union:  # Optional[X]: null is fine, else X's shape
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = inner[0] if len(inner) == 1 else typing.Any
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    mapping, listing = dataclasses.is_dataclass(hint) or origin is dict, origin is list
    if (
        (mapping or listing)
        and node is not None
        and not isinstance(node, dict if mapping else list)
    ):
        return [
            problem(
                path,
                f"{node!r} is not {'a mapping' if mapping else 'a list'} (in {source})",
                f"write {path} as "
                + ("a mapping, e.g. {key: value}" if mapping else "a list, e.g. [a, b]"),
            )
        ]
    out = []
    if isinstance(node, dict) and (mapping or hint is typing.Any):
        fields = typing.get_type_hints(hint) if dataclasses.is_dataclass(hint) else {}
        for key, value in node.items():
            sub = f"{path}.{key}" if path else str(key)
            if dataclasses.is_dataclass(hint) and key not in fields:
                continue  # an unknown key: the merge names it, with close matches
            inner = fields[key] if fields else args[1] if len(args) == 2 else typing.Any
            out += _shape_problems(value, inner, sub, source)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _shape_problems(value, args[0] if args else typing.Any, f"{path}[{i}]", source)
    return out


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> RLConfig:
    """Defaults, then the YAML file at `path` (if given), then `overrides` ("a.b=value"), validated."""
    if isinstance(overrides, str):  # a lone string would be split into characters
        overrides = [overrides]
    merged = OmegaConf.structured(RLConfig)
    layers = [(_read_yaml(path), path)] if path is not None else []
    layers.append((_read_overrides(overrides), "command-line overrides"))
    for layer, source in layers:
        for key in set(layer) & {f.name for f in dataclasses.fields(RLConfig)} - _LIST_SECTIONS:
            # OmegaConf's own error here names no field
            if not isinstance(layer.get(key), DictConfig):
                raise ConfigError(
                    [
                        problem(
                            key,
                            f"{layer.get(key)!r} is not a section (in {source})",
                            f"write {key} as a mapping of its fields, e.g. {key}.<field>=value",
                        )
                    ]
                )
        shape = _shape_problems(OmegaConf.to_container(layer, resolve=False), RLConfig, "", source)
        if shape:
            raise ConfigError(shape)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            # Inside a list of sections (tasks, agent_loop.judgers) OmegaConf names only the leaf key.
            where = _locate(OmegaConf.to_container(layer), e)
            raise _as_config_error(e, source, where) from None
        # a shape _shape_problems does not know yet: still no traceback
        except (TypeError, ValueError) as e:
            raise ConfigError(
                [
                    problem(
                        "config",
                        f"cannot merge {source}: {e}",
                        "check each value's kind (mapping, list, number, text) against "
                        "rlmega/config/schema.py",
                    )
                ]
            ) from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _as_config_error(e, "the merged config") from None
    # null = the policy loss's default (rollout_correction: tis when async); dumped and printed resolved
    cfg.algorithm.resolve_defaults(async_production=cfg.produce.strategy == "async")
    # a reward in a file of one's own: its path from here, as Ray's workers (elsewhere) must open it
    cfg.reward.fn = absolute(cfg.reward.fn)
    # a model judge's engine runs where the rollout engines do, unless set
    for task in cfg.tasks or [cfg]:
        for judger in task.agent_loop.judgers:
            judger.device = judger.device or cfg.rollout.device
            judger.fn = absolute(judger.fn)
    validate(cfg)
    return cfg


def dump_config(cfg: RLConfig) -> str:
    """The resolved config as YAML; `load_config` of this text gives back an equal RLConfig."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))

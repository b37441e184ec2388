"""On-policy distillation's rules (the distillation section, algorithm.advantage_estimator=opd), checked the
moment a config loads (called by rlmega.config.validate) and against the teachers' folders (called by
rlmega.preflight).

    lines = section_problems(cfg)                      # validate: teachers, their weights and tasks
    lines = model_problems(cfg, i, read_shape)         # validate: teacher i at the policy's layout
    lines = folder_problems(cfg)                       # preflight: each teacher folder, its tokenizer

Each returns `field: problem. Fix: ...` lines (rlmega.config.errors.problem). The rules:
- opd needs a teacher; a teacher needs a path and a weight > 0, and names only tasks the run has.
- opd alone does not drop groups by their rewards (dynamic sampling): its rewards carry no signal.
- A teacher runs on the trainer ranks at the policy's layout (parallelism; on fsdp with Ulysses), so its
  heads and layers divide as the policy's must.
- Its folder is a model the learner builds, with weights, and a tokenizer that is the student's: every
  token of model.path's tokenizer has the same id in the teacher's; the teacher may have more tokens
  after them, and its embedding covers every id the student can sample (config.json's vocab_size).
- Not built yet, refused here: a vision-language student or teacher (the teacher would need the
  prompt's images).
"""

from __future__ import annotations

import json
import os
from typing import Callable, List

from rlmega.config.errors import ConfigError, problem
from rlmega.config.hf_support import transformers_reason, unsupported_reason
from rlmega.config.learner_rules import ModelShape, divisors, megatron_model_problems
from rlmega.config.model_files import WEIGHT_GLOBS, tokenizer_problems, weight_problems
from rlmega.config.ranges import ranged_fields
from rlmega.config.resolved import task_configs
from rlmega.config.schema import RLConfig

FIELD = "distillation.teachers"


def distilling(cfg: RLConfig) -> bool:
    """Whether the run has a distillation term (teachers set; opd without one is refused at load)."""
    return bool(cfg.distillation.teachers)


def section_problems(cfg: RLConfig) -> List[str]:
    d, out = cfg.distillation, []
    if cfg.algorithm.advantage_estimator == "opd" and not d.teachers:
        out.append(
            problem(
                "algorithm.advantage_estimator",
                "opd distils from teachers, and distillation.teachers is empty",
                "add a teacher (distillation.teachers: [{path: TEACHER_FOLDER}]), or choose a reward "
                "estimator (grpo, rloo, reinforce_plus_plus, gae)",
            )
        )
    if cfg.algorithm.advantage_estimator == "opd" and cfg.algorithm.dynamic_sampling:
        out.append(
            problem(
                "algorithm.dynamic_sampling",
                "true with advantage_estimator=opd: it drops groups whose rewards are all equal, but under "
                "opd alone the rewards carry no signal and every group carries the teachers'",
                "set algorithm.dynamic_sampling=false, or mix opd's signal into a reward estimator "
                "(e.g. advantage_estimator=grpo with distillation.teachers)",
            )
        )
    names = [t.name for t in task_configs(cfg)]
    for i, t in enumerate(d.teachers):
        f = f"{FIELD}[{i}]"
        out += [
            problem(path, f"{value!r} must be {rule.words}", f"set {path} to a value {rule.words}")
            for path, value, rule in ranged_fields(t, f + ".")
            if not rule.ok(value)
        ]
        if not t.path:
            out.append(
                problem(
                    f"{f}.path",
                    "is empty",
                    "point it at the teacher's Hugging Face model folder (config.json, safetensors, tokenizer)",
                )
            )
        unknown = [name for name in t.tasks if name not in names]
        if unknown:
            out.append(
                problem(
                    f"{f}.tasks",
                    f"{unknown} name no task of this run (its tasks: {names})",
                    "name tasks[i].name values, or leave tasks empty for every task",
                )
            )
    return out


def model_problems(
    cfg: RLConfig, i: int, read_shape: Callable[[str, str], ModelShape]
) -> List[str]:
    """Teacher ``i``'s config.json: a text model (a vision-language one is refused), whose shape
    (``read_shape(path, field)``: rlmega.config.validate.read_model_shape) fits the policy's layout, which it
    runs at. [] when its folder has no config.json (preflight names that)."""
    f = f"{FIELD}[{i}].path"
    path = cfg.distillation.teachers[i].path
    hf = _config(path)
    if hf is None:
        return []
    if hf.get("vision_config") is not None:
        return [
            problem(
                f,
                f"{path!r} is a vision-language model: distillation does not yet give a teacher images",
                "use a text-only teacher",
            )
        ]
    try:
        shape = read_shape(path, f)
    except ConfigError as e:
        return e.problems
    if cfg.actor.backend == "megatron":
        return [
            p.replace("parallelism.", f"{f} (at parallelism.", 1).replace(": ", "): ", 1)
            if p.startswith("parallelism.")
            else p
            for p in megatron_model_problems("parallelism", cfg.parallelism, shape)
        ]
    u = cfg.actor.ulysses_size
    if u > 1 and (shape.num_attention_heads % u or shape.num_key_value_heads % u):
        both = [
            d for d in divisors(shape.num_attention_heads) if shape.num_key_value_heads % d == 0
        ]
        return [
            problem(
                f,
                f"actor.ulysses_size={u} does not divide the teacher's attention heads "
                f"({shape.num_attention_heads}) and KV heads ({shape.num_key_value_heads}); the teacher "
                "runs at the policy's layout",
                f"use a teacher whose heads it divides, or actor.ulysses_size in {both}",
            )
        ]
    return []


def folder_problems(cfg: RLConfig) -> List[str]:
    """Preflight: each teacher's folder is a model the learner builds, with its weights, and a tokenizer
    that is model.path's; a vision-language student or teacher is refused (not built yet)."""
    if not cfg.distillation.teachers:
        return []
    student = _config(cfg.model.path)
    if student is not None and student.get("vision_config") is not None:
        return [
            problem(
                FIELD,
                f"model.path {cfg.model.path!r} is a vision-language model: distillation does not yet "
                "give a teacher the prompts' images",
                "distil a text-only student, or leave distillation.teachers empty",
            )
        ]
    out = []
    for i, t in enumerate(cfg.distillation.teachers):
        if t.path:
            out += _teacher_problems(cfg, f"{FIELD}[{i}].path", t.path, student)
    return out


def _config(path: str) -> dict | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None
    return hf if isinstance(hf, dict) else None


def _teacher_problems(cfg: RLConfig, f: str, path: str, student: dict | None) -> List[str]:
    import glob

    fix = "point it at a Hugging Face model folder written by save_pretrained (config.json, weights, tokenizer)"
    if not os.path.isdir(path):
        return [problem(f, f"{path!r} is not a folder", fix)]
    hf = _config(path)
    if hf is None:
        return [problem(f, f"{path}/config.json is missing or not a JSON object", fix)]
    why = (
        unsupported_reason(hf) if cfg.actor.backend == "megatron" else transformers_reason(path, hf)
    )
    if why:
        return [
            problem(
                f,
                f"{path!r} (actor.backend={cfg.actor.backend}): {why}",
                "use a teacher of a family the learner builds (docs/backends.md)",
            )
        ]
    if not any(glob.glob(os.path.join(path, g)) for g in WEIGHT_GLOBS):
        return [problem(f, f"{path!r} has no weights ({' or '.join(WEIGHT_GLOBS)})", fix)]
    out = [problem(f, why, fix) for why in weight_problems(path, hf) + tokenizer_problems(path, hf)]
    if out or student is None:
        return out
    mismatch = tokenizer_mismatch(cfg.model.path, path)
    if mismatch:
        out.append(
            problem(
                f,
                f"the teacher's tokenizer is not the student's (model.path {cfg.model.path!r}): {mismatch}",
                "use a teacher that shares the student's tokenizer: its log-probs are of the student's "
                "token ids",
            )
        )
    elif isinstance(hf.get("vocab_size"), int) and isinstance(student.get("vocab_size"), int):
        if hf["vocab_size"] < student["vocab_size"]:
            out.append(
                problem(
                    f,
                    f"vocab_size={hf['vocab_size']} in {path}/config.json, below model.path's "
                    f"{student['vocab_size']}: an id the student samples past it has no row in the teacher",
                    "use a teacher whose embedding covers the student's vocabulary",
                )
            )
    return out


def _vocab(path: str) -> dict[str, int]:
    """token -> id of the folder's tokenizer (added tokens included)."""
    tj = os.path.join(path, "tokenizer.json")
    if os.path.exists(tj):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(tj).get_vocab(with_added_tokens=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).get_vocab()


def tokenizer_mismatch(student_path: str, teacher_path: str) -> str | None:
    """Why the teacher's tokenizer is not the student's (None when every student token has its id in the
    teacher's: the teacher may hold more tokens, with ids after them)."""
    try:
        student, teacher = _vocab(student_path), _vocab(teacher_path)
    except Exception as e:  # noqa: BLE001 -- any unreadable tokenizer: named, not raised
        return f"a tokenizer cannot be read ({type(e).__name__}: {str(e)[:200]})"
    differ = [tok for tok, i in student.items() if teacher.get(tok) != i]
    if not differ:
        return None
    tok = sorted(differ, key=lambda t: student[t])[0]
    return (
        f"{len(differ)} of the student's {len(student)} tokens differ, first {tok!r}: id "
        f"{student[tok]} in the student's, {teacher.get(tok)} in the teacher's"
    )

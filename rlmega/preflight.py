"""Checks of a valid config against this machine, run before any worker starts.

``validate`` (run by ``load_config``) checks that a config is consistent in itself; ``preflight``
checks that it can run HERE: the model folder (config.json, safetensors headers and tokenizer against
each other: rlmega/config/model_files.py), the reward function (importable, and its signature), the
data files, the run folder, the dashboard address, the devices, the embedded Ray's size, and whether
the embedded cluster's processes fit this machine's memory and cores. ``rlmega train`` and
``rlmega check-config`` run both, so a mistake costs seconds, not a cluster start-up. With
algorithm.advantage_estimator=gae also the critic's folder (critic.path: a value model or causal LM of the
policy's shape; rlmega/config/critic_rules.py) and the launch (torchrun cannot host the critic's worker group).

    cfg = load_config("configs/tiny_cpu.yaml")
    preflight(cfg)          # ConfigError listing every problem: "field: problem. Fix: ..."

Nothing heavy is imported (no megatron, no vLLM, no Ray); the reward module is imported, since
whether it resolves is the question, and with actor.backend=fsdp transformers' auto classes (whether
it builds the model is the question; vLLM's registry is read as text).

It sits above rlmega.config (which holds the rules it applies) because it inspects what the packages above
config own: the agent side's actors (rlmega.agents), the reward function, the prompt files, the devices.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import socket
import tempfile
from typing import List

from rlmega.agents.placement import run_cpus
from rlmega.config import critic_rules, distill_rules, lora_rules
from rlmega.config.agent_rules import IMAGE_TOOLS, task_loops
from rlmega.config.critic_rules import critic_ranks
from rlmega.config.engine_mode import records_routes
from rlmega.config.families import engine_reason, fsdp_reason
from rlmega.config.hf_support import transformers_reason, unsupported_reason, vllm_reason
from rlmega.config.model_files import WEIGHT_GLOBS, tokenizer_problems, weight_problems
from rlmega.config.resolved import task_configs, trainer_ranks
from rlmega.config.schema import RLConfig
from rlmega.config.validate import ConfigError, problem
from rlmega.data.prompts import JSONL_SUFFIXES, PARQUET_SUFFIXES


def _model(cfg: RLConfig) -> List[str]:
    path = cfg.model.path
    if not path:
        return [
            problem(
                "model.path",
                "is not set",
                "point model.path at a Hugging Face model folder "
                "(config.json, tokenizer and *.safetensors weights)",
            )
        ]
    if not os.path.isdir(path):
        return [
            problem(
                "model.path",
                f"{path!r} is not a folder",
                "point model.path at a Hugging Face model folder; no model hub is contacted",
            )
        ]
    out, hf = [], None
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        out.append(
            problem(
                "model.path",
                f"cannot read {path}/config.json: {e}",
                "give a Hugging Face model folder",
            )
        )
    if hf is not None and not isinstance(hf, dict):
        out.append(
            problem(
                "model.path",
                f"{path}/config.json holds a JSON {type(hf).__name__}, not an object",
                "give a config.json that is a JSON object, as save_pretrained writes it",
            )
        )
        hf = None
    reason = _architecture_reason(cfg, hf) if hf is not None else None
    if reason:
        out.append(reason)
    if not any(glob.glob(os.path.join(path, g)) for g in WEIGHT_GLOBS):
        out.append(
            problem(
                "model.path",
                f"{path!r} has no weights ({' or '.join(WEIGHT_GLOBS)})",
                "save the model with save_pretrained into that folder",
            )
        )
    elif hf is not None and not reason:
        out += [
            problem(
                "model.path",
                why,
                "save the model again with save_pretrained (config.json and weights "
                "together), or fix config.json to describe the weights",
            )
            for why in weight_problems(path, hf)
        ]
    if hf is not None:
        out += [
            problem(
                "model.path", why, "save the tokenizer with save_pretrained into the model folder"
            )
            for why in tokenizer_problems(path, hf)
        ]
    if hf is not None and not reason:
        out += lora_rules.module_problems(cfg, hf)
    if hf is not None and hf.get("vision_config") is None:
        out += [
            problem(
                f"{field}.tools",
                f"{sorted(set(loop.tools) & set(IMAGE_TOOLS))} answer with images; "
                f"model.path {path!r} is a text-only model",
                "use a vision-language model, or drop the tool",
            )
            for field, loop in task_loops(cfg)
            if loop.kind == "tool" and set(loop.tools) & set(IMAGE_TOOLS)
        ]
    return out


def _architecture_reason(cfg: RLConfig, hf: dict) -> str | None:
    """Whether the learner actor.backend names can train the folder's model, and vLLM serve it: megatron
    converts the architectures rlmega/config/hf_support.py maps; fsdp takes any causal LM that transformers
    builds and vLLM's registry names. The problem line, or None."""
    path = cfg.model.path
    if hf.get("vision_config") is not None:  # a vision-language model (docs/vision_language.md)
        return _vlm_reason(cfg, hf)
    if cfg.actor.backend == "megatron":
        why = unsupported_reason(hf)
        if why:
            return problem(
                "model.path",
                f"{path!r}: {why}",
                "use a model of an architecture listed there, or "
                "convert yours, or set actor.backend=fsdp (FSDP2 trains the families of docs/backends.md)",
            )
        refused = engine_reason(hf, cfg.model.dtype, cfg.rollout.device)
        return refused and problem(
            refused[0],
            f"{refused[1]} (model.path={path!r}; docs/backends.md's family table)",
            refused[2],
        )
    why = transformers_reason(path, hf)
    if why:
        return problem(
            "model.path",
            f"{path!r} (actor.backend=fsdp): {why}",
            "use a model folder whose config.json names a transformers causal LM (model_type and "
            "architectures), e.g. one written by save_pretrained",
        )
    why = vllm_reason(hf)
    if why:
        return problem(
            "model.path",
            f"{path!r} (actor.backend=fsdp): {why}",
            "use an architecture vLLM serves (vLLM's supported-models list), e.g. Llama, Qwen2, "
            "Phi3, Gemma",
        )
    refused = fsdp_reason(
        hf,
        cfg.model.dtype,
        cfg.rollout.device,
        cfg.actor.ulysses_size,
        cfg.model.allow_untested_family,
    )
    if refused:
        field, what, fix = refused
        return problem(
            field,
            f"{what} (model.path={path!r}, actor.backend=fsdp; docs/backends.md's family table)",
            fix,
        )
    return None


def _vlm_reason(cfg: RLConfig, hf: dict) -> str | None:
    """What of a vision-language model.path the settings cannot run (rlmega/fsdp/vision_inputs.py), or None."""
    from rlmega.fsdp.vision_inputs import MROPE_TYPES, VLM_TYPES

    kind, path = hf.get("model_type"), cfg.model.path
    what = f"{path!r} is a vision-language model ({kind})"
    if cfg.actor.backend == "megatron":
        return problem(
            "actor.backend",
            f"megatron: {what}; the Megatron learner trains text-only models",
            "set actor.backend=fsdp (the FSDP learner builds transformers' VLM classes)",
        )
    if kind not in VLM_TYPES:
        return problem(
            "model.path",
            f"{what}; the FSDP learner packs the images of {', '.join(VLM_TYPES)} only",
            "use one of those families",
        )
    if kind in MROPE_TYPES and cfg.rollout.device == "cpu" and not _torchvision_works():
        return problem(
            "rollout.device",
            f"cpu: vLLM's {kind} needs torchvision, which does not load here (no CPU "
            "build of it matches this torch: ../shared/CPU.md)",
            "set rollout.device=cuda, or serve an Idefics3/SmolVLM model on the CPU",
        )
    # not built yet for images (each would need the images in its own path)
    if cfg.actor.lora.rank:
        return problem(
            "actor.lora.rank",
            f"{cfg.actor.lora.rank}: LoRA is not built for images; {what}",
            "set actor.lora.rank=0",
        )
    if cfg.actor.ulysses_size > 1:
        return problem(
            "actor.ulysses_size",
            f"{cfg.actor.ulysses_size}: Ulysses sequence parallelism is not built "
            f"for images; {what}",
            "set actor.ulysses_size=1",
        )
    if cfg.algorithm.advantage_estimator == "gae":
        return problem(
            "algorithm.advantage_estimator",
            f"gae: the critic is not built for images; {what}",
            "use a critic-free estimator (grpo, grpo_no_std, rloo, reinforce_plus_plus)",
        )
    return None


def _torchvision_works() -> bool:
    try:
        import torchvision  # noqa: F401

        return True
    # missing, or a CUDA build beside a CPU torch ("operator torchvision::nms does not exist")
    except Exception:
        return False


def _engine_mode(cfg: RLConfig) -> List[str]:
    """rollout.enforce_eager=false where the engines must run eager (they record MoE routes)."""
    if cfg.rollout.enforce_eager is not False:
        return []
    try:
        recording = records_routes(cfg)
    # an unreadable or malformed config.json: _model says so
    except (OSError, ValueError, TypeError):
        return []
    if not recording:
        return []
    return [
        problem(
            "rollout.enforce_eager",
            "is false, but the engines record each token's routed experts (a "
            "mixture-of-experts model on actor.backend=megatron), and replayed CUDA graphs never call "
            "the recording hook",
            "leave rollout.enforce_eager null (eager for this model) or set it true",
        )
    ]


def _reward(cfg: RLConfig) -> List[str]:
    from rlmega.config.dotted_path import RewardResolveError, resolve
    from rlmega.config.judger_rules import SIGNATURE_FIX, signature_problem

    try:
        fn = resolve(cfg.reward.fn)
    except RewardResolveError as e:
        return [problem("reward.fn", e.what, e.fix)]
    why = signature_problem(fn, cfg.reward.kwargs)
    return [problem("reward.fn", why, SIGNATURE_FIX)] if why else []


def _data_file(
    field: str, path: str, prompt_key: str, label_key: str, section: str = "data"
) -> List[str]:
    """The file exists, is of the format its name says, and has the configured columns (first row)."""
    if not path:
        return []
    if not os.path.isfile(path):
        return [
            problem(
                field,
                f"prompt file {path!r} does not exist",
                'give an existing JSONL or Parquet file, or "" for data.synthetic_task',
            )
        ]
    suffix = os.path.splitext(path)[1].lower()
    keys = ((f"{section}.prompt_key", prompt_key), (f"{section}.label_key", label_key))
    if suffix in PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq

            columns = pq.ParquetFile(path).schema_arrow.names
        # pyarrow raises ArrowInvalid and friends for a file that is not Parquet
        except Exception as e:
            return [
                problem(
                    field,
                    f"{path!r} is not a readable Parquet file ({type(e).__name__}: {e})",
                    "write it with pandas.DataFrame.to_parquet / pyarrow, or use JSONL (.jsonl)",
                )
            ]
        return [
            problem(
                k,
                f"{path!r} has no column {v!r} (columns: {columns})",
                f"set {k} to one of the columns",
            )
            for k, v in keys
            if v not in columns
        ]
    if suffix not in JSONL_SUFFIXES:
        return [
            problem(
                field,
                f"{path!r}: unknown prompt file type {suffix!r}",
                f"use JSON Lines ({', '.join(JSONL_SUFFIXES)}) or Parquet ({', '.join(PARQUET_SUFFIXES)})",
            )
        ]
    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        return [problem(field, f"{path!r} is empty", "give a file with one JSON object per line")]
    try:
        row = json.loads(first.decode("utf-8-sig"))  # -sig: a BOM from a common editor is fine
    except (UnicodeDecodeError, ValueError) as e:
        return [
            problem(
                field,
                f"{path!r} row 1 is not a JSON object ({e})",
                "write JSON Lines: one JSON object per line, UTF-8",
            )
        ]
    if not isinstance(row, dict):
        return [
            problem(
                field,
                f"{path!r} row 1 is a {type(row).__name__}, not a JSON object",
                "write JSON Lines: one JSON object per line (e.g. jq -c '.[]' for a JSON array)",
            )
        ]
    return [
        problem(
            k,
            f"{path!r} row 1 has no key {v!r} (keys: {sorted(row)})",
            f"set {k} to one of the keys",
        )
        for k, v in keys
        if v not in row
    ]


def _run_dir(cfg: RLConfig) -> List[str]:
    path = os.path.abspath(cfg.trainer.run_dir)
    field = "trainer.run_dir"
    if os.path.exists(path) and not os.path.isdir(path):
        return [
            problem(
                field, f"{path!r} is a file", "point trainer.run_dir at a folder (new or existing)"
            )
        ]
    existing = path
    # the folder will be created under its nearest existing ancestor
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [
            problem(
                field,
                f"{path!r} cannot be created: {existing!r} is a file",
                "choose a run_dir that is not under a file",
            )
        ]
    try:  # a real write (os.access says yes to root, also where writing fails)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return [
            problem(
                field,
                f"cannot write in {existing!r} ({e.strerror or e})",
                "choose a run_dir on a writable filesystem where you have write permission",
            )
        ]
    return []


def _dashboard(cfg: RLConfig) -> List[str]:
    host = cfg.logging.dashboard_host
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        return [
            problem(
                "logging.dashboard_host",
                f"{host!r} does not resolve ({e})",
                "use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)",
            )
        ]
    return []


def _devices_and_cluster(cfg: RLConfig) -> List[str]:
    c, out = cfg.cluster, []
    if c.address:  # an existing cluster: its nodes' devices are not this machine's
        return out
    if cfg.rollout.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            out.append(
                problem(
                    "rollout.device",
                    "cuda, but this machine has no CUDA GPU (and no cluster.address "
                    "is set, so everything runs here)",
                    "set rollout.device=cpu, or attach to a GPU cluster with cluster.address",
                )
            )
    if c.num_cpus is not None and c.num_cpus < run_cpus(cfg):
        critic = " + the critic's world_size x actor_cpus_per_rank" if critic_ranks(cfg) else ""
        out.append(
            problem(
                "cluster.num_cpus",
                f"{c.num_cpus} CPUs, but the roles reserve {run_cpus(cfg):g} "
                f"(world_size x actor_cpus_per_rank{critic} + num_engines x engine_cpus + "
                f"agent-loop and judger actors): Ray could never place them",
                f"set cluster.num_cpus >= {run_cpus(cfg):g} (Ray CPUs are reservations, not cores), "
                "lower cluster.*_cpus, or leave cluster.num_cpus unset",
            )
        )
    return out


# Lower bounds of what each process of an embedded run takes, measured here: a Python process that has
# imported torch (every trainer rank and rollout engine) holds 219 MiB before any model; one that has
# imported ray (agent-loop and judger actors) 66 MiB. A CPU engine adds its KV cache.
RANK_OR_ENGINE_GIB, ACTOR_GIB = 0.2, 0.064
# Ray CPUs are reservations: an embedded Ray declares what the roles reserve even past the cores (the
# tiny CPU layout reserves 2.75 on 2 cores). Past this many per core each process gets too little of one.
MAX_RESERVED_PER_CORE = 8


def _machine_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _machine(cfg: RLConfig) -> List[str]:
    """An embedded cluster runs every role on this machine: its processes must fit its cores and memory."""
    if cfg.cluster.address:
        return []
    from rlmega.agents.placement import effective_judgers, task_bundles

    r, cores, mem = cfg.rollout, os.cpu_count() or 1, _machine_memory_gib()
    # Under torchrun only this node's ranks run here (the engines and actors on the embedded Ray do).
    ranks = (
        int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallelism.world_size))
        if "TORCHELASTIC_RUN_ID" in os.environ
        else trainer_ranks(cfg)
    )
    actors = 0
    for t in task_configs(cfg):
        loops, judges = task_bundles(
            t.agent_loop, effective_judgers(t.agent_loop, cfg.reward, cfg.cluster.reward_cpus)
        )
        actors += len(loops) + sum(len(inst) for inst in judges)
    kv = r.kv_cache_space_gb if r.device == "cpu" else 0.0
    need = (ranks + r.num_engines) * RANK_OR_ENGINE_GIB + r.num_engines * kv + actors * ACTOR_GIB
    out = []
    critic = " (the critic's included)" if critic_ranks(cfg) else ""
    what = (
        f"{ranks} trainer ranks{critic}, {r.num_engines} engines"
        f"{f' with {kv:g} GiB of KV cache each' if kv else ''} and {actors} agent/judger actors"
    )
    if need > mem:
        out.append(
            problem(
                "rollout.num_engines"
                if r.num_engines * (RANK_OR_ENGINE_GIB + kv) > need / 2
                else "agent_loop.num_ray_actors",
                f"{what} need at least {need:.1f} GiB, but this machine has {mem:.1f} GiB "
                "(the embedded cluster runs them all here)",
                "use fewer engines, actors or trainer ranks (or a smaller rollout.kv_cache_space_gb), "
                "or attach to a larger cluster with cluster.address",
            )
        )
    # runs, but nobody should be surprised that it crawls (issue 56: world 8 on 2 cores). Two ranks a core is
    # the demo's TP2 x PP2 on this 2-core machine, whose ranks share the cores by design (launch/threads.py).
    if ranks > 2 * cores:
        logging.getLogger("rlmega.preflight").warning(
            "%s on this %d-core machine: more than two trainer ranks a core, so they take turns and every step "
            "waits for the slowest. Fine for trying a layout; for speed, give each rank a core (or attach to a "
            "cluster with cluster.address)",
            what[0].upper() + what[1:],
            cores,
        )
    reserved = run_cpus(cfg)
    if reserved > MAX_RESERVED_PER_CORE * cores:
        out.append(
            problem(
                "cluster",
                f"{what} reserve {reserved:g} Ray CPUs, more than {MAX_RESERVED_PER_CORE} "
                f"per core of this {cores}-core machine (the embedded cluster runs them all here)",
                "use fewer engines, actors or trainer ranks, or attach to a larger cluster with "
                "cluster.address",
            )
        )
    return out


def _torchrun(cfg: RLConfig) -> List[str]:
    """Under torchrun its processes are the trainer ranks (launch/torchrun_group.py): as many as the config's,
    and the policy's only (the critic of gae would need a worker group of its own)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "WORLD_SIZE" not in os.environ:
        return []
    started, world = int(os.environ["WORLD_SIZE"]), cfg.parallelism.world_size
    out = []
    if cfg.algorithm.advantage_estimator == "gae":
        out.append(
            problem(
                "algorithm.advantage_estimator",
                "gae trains a critic in worker processes of its own, but "
                "under torchrun the trainer ranks are torchrun's processes and host the policy only: "
                "there is no second worker group for the critic",
                "launch with Ray instead: "
                "rlmega train CONFIG (without torchrun; cluster.address to attach to a cluster), or use "
                "an estimator without a critic (grpo, rloo, reinforce_plus_plus) under torchrun",
            )
        )
    if started != world:
        out.append(
            problem(
                "parallelism.world_size",
                f"is {world} but torchrun started {started} processes",
                f"start torchrun with --nnodes x --nproc-per-node = {world}, "
                f"or set parallelism.world_size={started}",
            )
        )
    if cfg.rollout.device == "cuda" and not cfg.cluster.address:
        # An embedded Ray would hand the engines GPUs that torchrun's ranks already use (both count from 0).
        out.append(
            problem(
                "cluster.address",
                "is empty, so rank 0 would start a Ray that shares the trainer "
                "ranks' GPUs with the rollout engines",
                "under torchrun, start a Ray cluster on GPUs "
                "the trainer ranks do not use (other nodes, or CUDA_VISIBLE_DEVICES) and set "
                "cluster.address to it",
            )
        )
    return out


def preflight(cfg: RLConfig) -> None:
    """Raise one ConfigError listing every way ``cfg`` cannot run on this machine."""

    out = _model(cfg) + _engine_mode(cfg) + critic_rules.folder_problems(cfg) + _reward(cfg)
    out += distill_rules.folder_problems(cfg)
    # each task's prompt files (the data section's)
    for i, t in enumerate(cfg.tasks or task_configs(cfg)):
        f, d = (f"tasks[{i}].data" if cfg.tasks else "data"), t.data
        out += _data_file(
            f"{f}.train_path", d.train_path, d.prompt_key, d.label_key, f
        ) + _data_file(f"{f}.eval_path", d.eval_path, d.prompt_key, d.label_key, f)
    out += (
        _run_dir(cfg) + _dashboard(cfg) + _devices_and_cluster(cfg) + _machine(cfg) + _torchrun(cfg)
    )
    if out:
        raise ConfigError(out)

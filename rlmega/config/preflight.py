"""Checks of a valid config against this machine, run before any worker starts.

``validate`` (run by ``load_config``) checks that a config is consistent in itself; ``preflight``
checks that it can run HERE: the model folder, the reward function, the data files, the run
folder, the dashboard address, the devices and the embedded Ray's size. ``rlmega train`` and
``rlmega check-config`` run both, so a mistake costs seconds, not a cluster start-up.

    cfg = load_config("configs/tiny_cpu.yaml")
    preflight(cfg)          # ConfigError listing every problem: "field: problem. Fix: ..."

Nothing heavy is imported (no megatron, no vLLM, no Ray); the reward module is imported, since
whether it resolves is the question.
"""
from __future__ import annotations

import glob
import json
import os
import socket
import tempfile
from typing import List

from rlmega.config.hf_support import unsupported_reason
from rlmega.config.schema import RLConfig
from rlmega.config.validate import ConfigError, problem
from rlmega.data.prompts import JSONL_SUFFIXES, PARQUET_SUFFIXES

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


def roles_cpus(cfg: RLConfig) -> float:
    """Ray CPUs the run's roles reserve (trainer ranks, engines, agent-loop and judger actors)."""
    from rlmega.agents.placement import agent_cpus
    from rlmega.agents.tasks import task_configs

    c = cfg.cluster
    return (cfg.parallelism.world_size * c.actor_cpus_per_rank + cfg.rollout.num_engines * c.engine_cpus
            + agent_cpus(task_configs(cfg), cfg.reward, c.reward_cpus))


def _model(cfg: RLConfig) -> List[str]:
    path = cfg.model.path
    if not path:
        return [problem("model.path", "is not set", "point model.path at a Hugging Face model folder "
                        "(config.json, tokenizer and *.safetensors weights)")]
    if not os.path.isdir(path):
        return [problem("model.path", f"{path!r} is not a folder", "point model.path at a Hugging Face model "
                        "folder; no model hub is contacted")]
    out = []
    try:
        with open(os.path.join(path, "config.json")) as f:
            reason = unsupported_reason(json.load(f))
        if reason:
            out.append(problem("model.path", f"{path!r}: {reason}", "use a Llama or Qwen2 model, or convert yours"))
    except (OSError, ValueError) as e:
        out.append(problem("model.path", f"cannot read {path}/config.json: {e}", "give a Hugging Face model folder"))
    if not any(glob.glob(os.path.join(path, g)) for g in WEIGHT_GLOBS):
        out.append(problem("model.path", f"{path!r} has no weights ({' or '.join(WEIGHT_GLOBS)})",
                           "save the model with save_pretrained into that folder"))
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        out.append(problem("model.path", f"{path!r} has no tokenizer (tokenizer.json)",
                           "save the tokenizer with save_pretrained into the model folder"))
    return out


def _reward(cfg: RLConfig) -> List[str]:
    from rlmega.rewards.registry import RewardResolveError, resolve

    try:
        resolve(cfg.reward.fn)
    except RewardResolveError as e:
        return [problem("reward.fn", e.what, e.fix)]
    return []


def _data_file(field: str, path: str, prompt_key: str, label_key: str) -> List[str]:
    """The file exists, is of the format its name says, and has the configured columns (first row)."""
    if not path:
        return []
    if not os.path.isfile(path):
        return [problem(field, f"prompt file {path!r} does not exist",
                        'give an existing JSONL or Parquet file, or "" for the synthetic arithmetic task')]
    suffix = os.path.splitext(path)[1].lower()
    keys = (("data.prompt_key", prompt_key), ("data.label_key", label_key))
    if suffix in PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq

            columns = pq.ParquetFile(path).schema_arrow.names
        except Exception as e:  # pyarrow raises ArrowInvalid and friends for a file that is not Parquet
            return [problem(field, f"{path!r} is not a readable Parquet file ({type(e).__name__}: {e})",
                            "write it with pandas.DataFrame.to_parquet / pyarrow, or use JSONL (.jsonl)")]
        return [problem(k, f"{path!r} has no column {v!r} (columns: {columns})", f"set {k} to one of the columns")
                for k, v in keys if v not in columns]
    if suffix not in JSONL_SUFFIXES:
        return [problem(field, f"{path!r}: unknown prompt file type {suffix!r}",
                        f"use JSON Lines ({', '.join(JSONL_SUFFIXES)}) or Parquet ({', '.join(PARQUET_SUFFIXES)})")]
    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        return [problem(field, f"{path!r} is empty", "give a file with one JSON object per line")]
    try:
        row = json.loads(first.decode("utf-8-sig"))  # -sig: a BOM from a common editor is fine
    except (UnicodeDecodeError, ValueError) as e:
        return [problem(field, f"{path!r} row 1 is not a JSON object ({e})",
                        "write JSON Lines: one JSON object per line, UTF-8")]
    if not isinstance(row, dict):
        return [problem(field, f"{path!r} row 1 is a {type(row).__name__}, not a JSON object",
                        "write JSON Lines: one JSON object per line (e.g. jq -c '.[]' for a JSON array)")]
    return [problem(k, f"{path!r} row 1 has no key {v!r} (keys: {sorted(row)})", f"set {k} to one of the keys")
            for k, v in keys if v not in row]


def _run_dir(cfg: RLConfig) -> List[str]:
    path = os.path.abspath(cfg.trainer.run_dir)
    field = "trainer.run_dir"
    if os.path.exists(path) and not os.path.isdir(path):
        return [problem(field, f"{path!r} is a file", "point trainer.run_dir at a folder (new or existing)")]
    existing = path
    while not os.path.exists(existing):  # the folder will be created under its nearest existing ancestor
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [problem(field, f"{path!r} cannot be created: {existing!r} is a file",
                        "choose a run_dir that is not under a file")]
    try:  # a real write (os.access says yes to root, also where writing fails)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return [problem(field, f"cannot write in {existing!r} ({e.strerror or e})",
                        "choose a run_dir on a writable filesystem where you have write permission")]
    return []


def _dashboard(cfg: RLConfig) -> List[str]:
    host = cfg.logging.dashboard_host
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        return [problem("logging.dashboard_host", f"{host!r} does not resolve ({e})",
                        "use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")]
    return []


def _devices_and_cluster(cfg: RLConfig) -> List[str]:
    c, out = cfg.cluster, []
    if c.address:  # an existing cluster: its nodes' devices are not this machine's
        return out
    if cfg.rollout.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            out.append(problem("rollout.device", "cuda, but this machine has no CUDA GPU (and no cluster.address "
                               "is set, so everything runs here)",
                               "set rollout.device=cpu, or attach to a GPU cluster with cluster.address"))
    if c.num_cpus is not None and c.num_cpus < roles_cpus(cfg):
        out.append(problem("cluster.num_cpus", f"{c.num_cpus} CPUs, but the roles reserve {roles_cpus(cfg):g} "
                           f"(world_size x actor_cpus_per_rank + num_engines x engine_cpus + "
                           f"agent-loop and judger actors): Ray could never place them",
                           f"set cluster.num_cpus >= {roles_cpus(cfg):g} (Ray CPUs are reservations, not cores), "
                           "lower cluster.*_cpus, or leave cluster.num_cpus unset"))
    return out


def _torchrun(cfg: RLConfig) -> List[str]:
    """Under torchrun its processes are the trainer ranks (launch/torchrun_group.py): as many as the config's."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "WORLD_SIZE" not in os.environ:
        return []
    started, world = int(os.environ["WORLD_SIZE"]), cfg.parallelism.world_size
    out = []
    if started != world:
        out.append(problem("parallelism.world_size", f"is {world} but torchrun started {started} processes",
                           f"start torchrun with --nnodes x --nproc-per-node = {world}, "
                           f"or set parallelism.world_size={started}"))
    if cfg.rollout.device == "cuda" and not cfg.cluster.address:
        # An embedded Ray would hand the engines GPUs that torchrun's ranks already use (both count from 0).
        out.append(problem("cluster.address", "is empty, so rank 0 would start a Ray that shares the trainer "
                           "ranks' GPUs with the rollout engines", "under torchrun, start a Ray cluster on GPUs "
                           "the trainer ranks do not use (other nodes, or CUDA_VISIBLE_DEVICES) and set "
                           "cluster.address to it"))
    return out


def preflight(cfg: RLConfig) -> None:
    """Raise one ConfigError listing every way ``cfg`` cannot run on this machine."""
    d = cfg.data
    out = (_model(cfg) + _reward(cfg) + _data_file("data.train_path", d.train_path, d.prompt_key, d.label_key)
           + _data_file("data.eval_path", d.eval_path, d.prompt_key, d.label_key) + _run_dir(cfg)
           + _dashboard(cfg) + _devices_and_cluster(cfg) + _torchrun(cfg))
    if out:
        raise ConfigError(out)

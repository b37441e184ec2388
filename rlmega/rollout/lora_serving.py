"""LoRA adapters served unmerged by a RolloutWorker (actor.lora with rollout.lora_merge false).

The engine serves one adapter, the policy's, replaced in place by each weight sync. vLLM loads adapters from
folders (``LoRARequest(name, id, path)``), so each version's files (a PEFT adapter folder:
adapter_config.json, adapter_model.safetensors) are written to a folder of their own in shared memory
(/dev/shm: no disk) and loaded with ``add_lora(load_inplace=True)`` under one fixed id. The engine core runs
that call between engine steps, so no step sees half an adapter. The previous version's folder is removed
once the new one is in. Requests carry the version's ``LoRARequest`` without ``load_inplace`` (with it vLLM
would read the folder again at every engine step). Every engine request sent after a load generates with the
new adapter; one in flight during a sync between rollouts takes it from its next engine step on, as
in-flight requests take new weights (docs/rollout_engine.md).

The engine's own weights are the base (model.path, or the base the trainer sends first: a LoRA run resumed
from a full-parameter checkpoint trains on that checkpoint's weights; rlmega/launch/roles.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile

ADAPTER_ID = 1  # vLLM's lora_int_id of the policy's adapter (> 0)


def _root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def load(worker, files: dict[str, bytes], version: int):
    """Write ``files`` to a new folder and load them into ``worker``'s engine in place of the adapter before.
    Returns (the LoRARequest requests carry, the new folder)."""
    from vllm.lora.request import LoRARequest

    missing = {"adapter_config.json", "adapter_model.safetensors"} - set(files)
    if missing:
        raise ValueError(
            f"load_adapter: a PEFT adapter folder's files are needed, {sorted(missing)} missing"
        )
    folder = tempfile.mkdtemp(prefix=f"rlmega-lora-{os.getpid()}-v{version}-", dir=_root())
    try:
        for name, data in files.items():
            if os.path.basename(name) != name:
                raise ValueError(f"load_adapter: {name!r} is not a plain file name")
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        name = f"rlmega-policy-v{version}"
        worker._run(
            worker._engine.add_lora(LoRARequest(name, ADAPTER_ID, folder, load_inplace=True))
        )
    except BaseException:
        remove_folder(folder)
        raise
    return LoRARequest(name, ADAPTER_ID, folder), folder


def remove_folder(folder: str | None) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)

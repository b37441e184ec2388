#!/usr/bin/env python3
"""Make the bundle that brings `rlmega train`'s missing packages to the GPU machine in a few device calls, and print
those calls (tools/gpu/prove.py runs the GPU proof list once they are in).

The GPU machine has no internet and takes at most 64 MiB a call (working tree included). It has torch 2.11,
transformers and most of the scientific stack, but not vLLM, Ray, megatron-core, omegaconf, uvicorn or math-verify.
So they travel as one xz bundle split into parts that each fit a call:

- vLLM 0.26.0 (a 290 MiB wheel) stripped to ~106 MiB unpacked (no flash-attention, no MoE kernels unless --moe);
- Ray 2.60.0 (a 76 MiB wheel) without its Java jars and the dashboard's web client (~159 MiB unpacked);
- the wheels of their and rlmega's dependencies that the machine lacks (MACHINE_PACKAGES says what it has;
  ``check_closure`` proves every requirement is met by one or the other before anything is written).

What is stripped and patched, and why, is in tools/gpu/README.md and in BUNDLE_README below (it goes inside the
bundle). Stdlib only; downloads go through ``pip download``.

    python tools/gpu/make_bundle.py                 # -> .gpucarry/{part1,part2,install.sh,smoke_kernels.py,CALLS.md}
    python tools/gpu/make_bundle.py --moe           # + vLLM's MoE kernels (prove.py step d): one part more
    python tools/gpu/make_bundle.py --offline       # use the cached wheels only

Idempotent: wheels are cached (with their sha256 checked) under <out>/cache/wheels, and the bundle is only
recompressed when the staged content changed (the tar is deterministic: sorted names, fixed mtime and owner,
so the same inputs give the same bundle sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

MiB = 1 << 20

# ---------------------------------------------------------------------------------------------------------------
# What goes in. Exact files (name + sha256), as in the bundle that passed tests/gpu on an H100 (.gpucarry README).
# ---------------------------------------------------------------------------------------------------------------
VLLM_VERSION = "0.26.0"
VLLM_WHEEL = (
    "vllm==0.26.0",
    "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de",
)

# vLLM's runtime dependencies that the GPU machine lacks and a dense-model LLM/AsyncLLM engine imports
# (cp312 manylinux x86_64 or pure Python). Installed with --no-deps.
VLLM_DEP_WHEELS = [
    (
        "annotated-types==0.8.0",
        "annotated_types-0.8.0-py3-none-any.whl",
        "f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0",
    ),
    (
        "cachetools==8.0.2",
        "cachetools-8.0.2-py3-none-any.whl",
        "502bf3c17c6e35d78ccdaa70da8c7001b28634541f5cde0dee33c93bb252277d",
    ),
    (
        "cbor2==6.3.0",
        "cbor2-6.3.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        "4f160b662059cc30ced4436fca332f4c27d0259698a5bde8373c9c6f829aabdf",
    ),
    (
        "distro==1.9.0",
        "distro-1.9.0-py3-none-any.whl",
        "7bffd925d65168f85027d8da9af6bddab658135b840670a223589bc0c8ef02b2",
    ),
    (
        "fastapi==0.136.3",
        "fastapi-0.136.3-py3-none-any.whl",
        "3d2a69bdf04b7e9f3afa292c3bc7a98816bbfafa10bc9b45f3f3700d2f761620",
    ),
    (
        "jiter==0.19.0",
        "jiter-0.19.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "0956b5f58b804221dfb929c120e6d4032138fed20c1cc0ef683a2d1326255e46",
    ),
    (
        "msgspec==0.22.0",
        "msgspec-0.22.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
        "99c401861c5bb3a57f7d6423ea7ed4352cd57aa3f04f4fbe9f3e3e4564a10f08",
    ),
    (
        "openai==2.54.0",
        "openai-2.54.0-py3-none-any.whl",
        "89089789197ccdb87f173a03145ed1598d00795220c93e96cf712b1cbf5e5f2b",
    ),
    (
        "openai-harmony==0.0.8",
        "openai_harmony-0.0.8-cp38-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "c007d277218a50db8839e599ed78e0fffe5130f614c3f6d93ae257f282071a29",
    ),
    (
        "partial-json-parser==0.2.1.1.post7",
        "partial_json_parser-0.2.1.1.post7-py3-none-any.whl",
        "145119e5eabcf80cbb13844a6b50a85c68bf99d376f8ed771e2a3c3b03e653ae",
    ),
    (
        "pybase64==1.5.1",
        "pybase64-1.5.1-cp312-cp312-manylinux1_x86_64.manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_5_x86_64.whl",
        "c212d02fd072c5845d39b4699eb65efa827b79a5cf7fecc9f468f8cad2b8540f",
    ),
    (
        "pydantic==2.14.4",
        "pydantic-2.14.4-py3-none-any.whl",
        "653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc",
    ),
    (
        "pydantic-core==2.50.5",
        "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d",
    ),
    (
        "pyzmq==27.3.0",
        "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
        "858fe25231e0fd8612da142efde019faa5ef63fa150a821a27870e791b38c798",
    ),
    (
        "setproctitle==1.3.8",
        "setproctitle-1.3.8-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl",
        "4a765e0c80a2453480be27c4fc22ba1c0771867040c5f91e4221940d78a4abfb",
    ),
    (
        "sniffio==1.3.1",
        "sniffio-1.3.1-py3-none-any.whl",
        "2f6da418d1f1e0fddd844478f41680e794e6051915791a034ff65e5f100525a2",
    ),
    (
        "starlette==1.10.0",
        "starlette-1.10.0-py3-none-any.whl",
        "478c0ab3b4ced6e82719849c118fa406f0278a3499c1a898cd15cd31bdc38ce4",
    ),
    (
        "typing-inspection==0.4.5",
        "typing_inspection-0.4.5-py3-none-any.whl",
        "bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39",
    ),
]

# What rlmega's trainer needs on that machine (it has torch, transformers, ...; not these).
TRAINER_WHEELS = [
    (
        "megatron-core==0.16.1",
        "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "3fb26cb407aa3c4b609c08664022c08146f1648b3d6f2ef2bbe9d3b1294ace61",
    ),
    (
        "omegaconf==2.4.0",
        "omegaconf-2.4.0-py3-none-any.whl",
        "f141a664c777582405e3cc6e0545ecc79429e79f844995b1a6e71c35946a025c",
    ),
    (
        "antlr4-python3-runtime==4.13.2",
        "antlr4_python3_runtime-4.13.2-py3-none-any.whl",
        "fe3835eb8d33daece0e799090eda89719dbccee7aa39ef94eed3818cafa5a7e8",
    ),
]

# Ray for the embedded cluster `rlmega train` starts (cp312 manylinux2014), unpacked into ray_tree/ less RAY_STRIP_DIRS.
RAY_WHEEL = (
    "ray==2.60.0",
    "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl",
    "b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a",
)
RAY_STRIP_DIRS = [
    "ray/jars/",  # 33 MB: Java workers (ray_dist.jar); rlmega's workers are Python
    "ray/dashboard/client/build/",  # 10 MB: the dashboard's web client; rlmega starts Ray with include_dashboard=False
]
RAY_MUST_KEEP = [
    "ray/_raylet.so",
    "ray/core/src/ray/gcs/gcs_server",
    "ray/core/src/ray/raylet/raylet",
]

# What else `rlmega train` (setup.py's CORE) and Ray/vLLM need that the machine lacks, as wheels (--no-deps).
RUN_WHEELS = [
    (
        "jsonschema==4.26.0",
        "jsonschema-4.26.0-py3-none-any.whl",
        "d489f15263b8d200f8387e64b4c3a75f06629559fb73deb8fdfb525f2dab50ce",
    ),
    (
        "jsonschema-specifications==2025.9.1",
        "jsonschema_specifications-2025.9.1-py3-none-any.whl",
        "98802fee3a11ee76ecaca44429fda8a41bff98b00a0f2838151b113f210cc6fe",
    ),
    (
        "referencing==0.37.0",
        "referencing-0.37.0-py3-none-any.whl",
        "381329a9f99628c9069361716891d34ad94af76e461dcb0335825aecc7692231",
    ),
    (
        "rpds-py==2026.9.1",
        "rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "addeda51556dac7c1a2f14cda62db8b621cd12afba3091d03a96c72932387eab",
    ),
    (
        "uvicorn==0.54.0",
        "uvicorn-0.54.0-py3-none-any.whl",
        "505bdb0f318731d45f1f712071fc781a8981f6847a31c902c9f5e652d4f67faf",
    ),
    (
        "math-verify==0.9.0",
        "math_verify-0.9.0-py3-none-any.whl",
        "3703e7c4885354027fa84409d762a596a2906d1fd4deb78361876bd905a76194",
    ),
    (
        "latex2sympy2_extended==1.11.0",
        "latex2sympy2_extended-1.11.0-py3-none-any.whl",
        "aebb77d52ce269e25028e4bea89ddb14d242ba36bcf7b636496fb5fd9728d234",
    ),
]

# The GPU machine's Python packages (the device tool's KINDS.md, "Python packages already there", read
# 2026-11-17; names only: versions are not listed there). check_closure holds every requirement against this.
MACHINE_PACKAGES = set(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()
)

# vLLM 0.26's requirements that are neither on the machine nor carried, and why an eager-or-graphs dense (and, with
# --moe, MoE) LLM/AsyncLLM engine runs without them. check_closure stops when vLLM's list and this one drift apart.
VLLM_LEFT_OUT = {
    "blake3": "multimodal hashing (text-only prompts)",
    "prometheus-fastapi-instrumentator": "the API server's metrics (rlmega serves its own)",
    "lm-format-enforcer": "structured output (patched to lazy annotations)",
    "llguidance": "structured output (patched)",
    "outlines-core": "structured output",
    "lark": "structured output",
    "xgrammar": "structured output (patched)",
    "mistral-common": "Mistral tokenizers",
    "compressed-tensors": "quantized checkpoints",
    "depyf": "compile debugging dumps",
    "watchfiles": "the API server's reload",
    "python-json-logger": "JSON logs",
    "ijson": "the API server's streaming parser",
    "anthropic": "the Anthropic-compatible API server",
    "model-hosting-container-standards": "SageMaker serving",
    "mcp": "tool servers of the API server",
    "opentelemetry-sdk": "tracing",
    "opentelemetry-api": "tracing",
    "opentelemetry-exporter-otlp": "tracing",
    "opentelemetry-semantic-conventions-ai": "tracing",
    "torchcodec": "video/audio inputs",
    "pynvvideocodec": "video inputs",
    "flashinfer-python": "flashinfer kernels and sampler (VLLM_USE_FLASHINFER_SAMPLER=0: PyTorch's)",
    "apache-tvm-ffi": "flashinfer's FFI",
    "tilelang": "tilelang kernels",
    "nvidia-cudnn-frontend": "cuDNN attention",
    "nvtx": "NVTX ranges",
    "fastsafetensors": "GPU-direct loading",
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (FA4)",
    "quack-kernels": "CuTe-DSL kernels",
    "tokenspeed-mla": "DeepSeek MLA kernels",
    "humming-kernels": "quant kernels",
}

# Paths removed from the vllm wheel (each must match something, or the script stops).
STRIP_FILES = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # 305 MB FlashAttention-2 (TRITON_ATTN is used instead)
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",  # 153 MB FlashAttention-3
    "vllm/_moe_C_stable_libtorch.abi3.so",  # 47 MB MoE kernels (torch.ops._moe_C); kept with --moe
    "vllm/vllm-rs",  # 43 MB Rust API-server frontend binary
    "vllm/_flashmla_C.abi3.so",  # FlashMLA (DeepSeek MLA)
    "vllm/_flashmla_extension_C.abi3.so",
    "vllm/_qutlass_C.abi3.so",  # FP4 quant kernels
    "vllm/_rust_tool_parser.abi3.so",  # Rust tool-call parser (API server)
]
STRIP_DIRS = [
    "vllm/vllm_flash_attn/cute/",  # FA4 CuTe-DSL sources (need nvidia-cutlass-dsl)
    "vllm/third_party/deep_gemm/",  # 35 MB DeepGEMM (FP8 GEMM)
    "vllm/third_party/fmha_sm100/",  # 30 MB Blackwell FMHA (MiniMax-M3 only)
    "vllm/third_party/tml_fa4/",  # FA4 for the "inkling" model only
    "vllm/entrypoints/serve/instrumentator/static/",  # swagger-ui assets of the API server
]
MOE_KERNELS = "vllm/_moe_C_stable_libtorch.abi3.so"
MUST_KEEP = [
    "vllm/_C_stable_libtorch.abi3.so",  # core custom ops, imported unconditionally by platforms/cuda.py
    "vllm/cumem_allocator.abi3.so",  # sleep / wake_up
    "vllm/spinloop.abi3.so",
    "vllm/fs_io_C.abi3.so",
]

# Source patches: (path, old, new). `old` must occur exactly once, else the script stops.
_FA_NOTE = "  # STRIPPED BUNDLE: FA .so removed; keep module importable (TRITON_ATTN is used)"
_LAZY = "from __future__ import annotations  # STRIPPED BUNDLE: {why}; keep annotations lazy\n"
_SPDX = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
PATCHES = [
    # 1. vllm_flash_attn raises ImportError without the FA2/FA3 .so; fa_utils.py imports it at module level
    #    for every model on CUDA. With the raise disabled FA2/FA3/FA4_AVAILABLE are False.
    (
        "vllm/vllm_flash_attn/__init__.py",
        "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n",
        "if False and not (FA2_AVAILABLE or FA3_AVAILABLE):" + _FA_NOTE + "\n",
    ),
    # 2. structured-output backends are imported at engine start and have class-level annotations that make the
    #    LazyLoader import llguidance / xgrammar / lm-format-enforcer (not shipped). Lazy annotations fix that.
    (
        "vllm/v1/structured_output/backend_guidance.py",
        _SPDX + "\nimport copy\n",
        _SPDX + "\n" + _LAZY.format(why="llguidance not shipped") + "\nimport copy\n",
    ),
    (
        "vllm/v1/structured_output/backend_xgrammar.py",
        _SPDX + "\nimport json\n",
        _SPDX + "\n" + _LAZY.format(why="optional grammar lib not shipped") + "\nimport json\n",
    ),
    (
        "vllm/v1/structured_output/backend_lm_format_enforcer.py",
        _SPDX + "import ast\n",
        _SPDX + _LAZY.format(why="optional grammar lib not shipped") + "\nimport ast\n",
    ),
]

# 2026-01-01T00:00:00Z, fixed so that the tar (and its sha256) is reproducible
TAR_MTIME = 1767225600
DEVICE_CARRY_LIMIT = 64 * MiB

BUNDLE_README = """\
# rlmega's GPU carry: stripped vLLM 0.26.0 (TRITON_ATTN, PyTorch sampler, no API server{moe_title}), Ray 2.60.0, wheels

Made by rlmega's tools/gpu/make_bundle.py (see tools/gpu/README.md there).
Source: vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl (290 MiB, 708 MiB unpacked) -> vllm_tree/;
ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl (76 MiB, 193 MiB unpacked) -> ray_tree/ (~159 MiB).

## Removed from Ray
{ray_strip}
(rlmega starts Ray with include_dashboard=False and Python workers only.)

## Removed from the vllm package
{strip}
and no __pycache__ (regenerated on demand). The dist-info (RECORD included) is kept unchanged.

Kept: vllm/_C_stable_libtorch.abi3.so (core custom ops: rms_norm, silu_and_mul, rotary, reshape_and_cache, ...),
vllm/cumem_allocator.abi3.so (sleep / wake_up), spinloop.abi3.so, fs_io_C.abi3.so, third_party/pynvml.py,
third_party/triton_kernels, third_party/flash_linear_attention, third_party/flashmla (Python only), all Python sources.

## Source patches (all marked "STRIPPED BUNDLE")
1. vllm/vllm_flash_attn/__init__.py: the `raise ImportError` when neither FA2 nor FA3 .so is present is disabled
   (`if False and not (...)`): v1/attention/backends/fa_utils.py imports vllm.vllm_flash_attn at module level for
   every model on CUDA. FA2/FA3/FA4_AVAILABLE are then False (one harmless log line "Cannot use FA version 2").
2. vllm/v1/structured_output/backend_{{guidance,xgrammar,lm_format_enforcer}}.py: `from __future__ import annotations`,
   so that the class-level annotations do not import llguidance / xgrammar / lm-format-enforcer at engine start.

## Wheels (wheels/, checked by SHA256SUMS)
vLLM's runtime dependencies the GPU machine lacks: {deps}
rlmega's trainer: {trainer}
What else `rlmega train`, Ray and vLLM need that the machine lacks: {run}

## Use
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
LLM(model=..., enforce_eager=True, attention_backend="TRITON_ATTN", ...)
(VLLM_USE_FLASHINFER_SAMPLER=0: otherwise the GPU sampler imports flashinfer, which is not shipped.
 VLLM_ATTENTION_BACKEND is unknown to 0.26.0: use the attention_backend engine argument.)
"""

INSTALL_SH = r"""#!/usr/bin/env bash
# GENERATED by tools/gpu/make_bundle.py: do not edit, rerun the script.
# Reassemble, check and install the carry on the GPU machine: stripped vLLM @@VLLM_VERSION@@, Ray, megatron-core,
# omegaconf and the rest rlmega train needs.
# Before it, each device call copied its part:   mkdir -p /tmp/w && cp @@OUTREL@@/partK/* /tmp/w/
# Usage: bash @@OUTREL@@/install.sh      (env overrides: W=/tmp/w SITE=/tmp/site PY=python3)
# Then:  export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
set -euo pipefail
W=${W:-/tmp/w}
SITE=${SITE:-/tmp/site}
if [ -z "${PY:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; else PY=python3; fi
fi
EXP_SIZE=@@SIZE@@
EXP_SHA=@@SHA@@
# name size sha256 of each part, in order
PARTS=(
@@PARTS@@
)
check_import() {
  PYTHONPATH="$SITE" "$PY" -c "
import vllm, vllm._C_stable_libtorch, vllm.cumem_allocator
from vllm import LLM, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
import megatron.core, omegaconf, ray, ray._raylet, uvicorn, math_verify, jsonschema
print('vllm', vllm.__version__, 'OK from', vllm.__file__)
print('megatron-core', megatron.core.__version__, '| ray', ray.__version__)"
}
if [ -f "$SITE/.rlmega_bundle_sha256" ] && [ "$(cat "$SITE/.rlmega_bundle_sha256")" = "$EXP_SHA" ]; then
  echo "bundle $EXP_SHA already installed in $SITE"; check_import; echo "done: export PYTHONPATH=$SITE"; exit 0
fi
B=$W/bundle.tar.xz
bad=0
for p in "${PARTS[@]}"; do
  read -r name size sha <<<"$p"
  f=$W/$name
  if [ ! -f "$f" ]; then
    echo "MISSING part $f: the machine was not the same warm one for all calls (or a call was skipped);" \
         "start again from call 1"; bad=1; continue
  fi
  got=$(stat -c %s "$f")
  if [ "$got" != "$size" ]; then echo "BAD part $f: $got bytes, expected $size"; bad=1; continue; fi
  echo "$sha  $f" | sha256sum -c --quiet - || { echo "BAD part $f: sha256 mismatch"; bad=1; }
done
[ "$bad" = 0 ] || exit 1
rm -f "$B"
for p in "${PARTS[@]}"; do read -r name size sha <<<"$p"; cat "$W/$name" >> "$B"; done
[ "$(stat -c %s "$B")" = "$EXP_SIZE" ] || { echo "bundle size $(stat -c %s "$B") != $EXP_SIZE"; exit 1; }
echo "$EXP_SHA  $B" | sha256sum -c -
rm -rf "$W/x" && mkdir -p "$W/x"
tar -C "$W/x" -xJf "$B"
(cd "$W/x/wheels" && sha256sum -c --quiet SHA256SUMS)
mkdir -p "$SITE"
rm -f "$SITE/.rlmega_bundle_sha256"
"$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$W"/x/wheels/*.whl
rm -rf "$SITE/vllm" "$SITE"/vllm-*.dist-info "$SITE/ray" "$SITE"/ray-*.dist-info
cp -a "$W/x/vllm_tree/." "$SITE/"
cp -a "$W/x/ray_tree/." "$SITE/"
cp "$W/x/README.md" "$SITE/RLMEGA_CARRY_README.md"
rm -rf "$W/x" "$B"
check_import
echo "$EXP_SHA" > "$SITE/.rlmega_bundle_sha256"
echo "done: export PYTHONPATH=$SITE"
"""

SMOKE_PY = '''\
# GENERATED by tools/gpu/make_bundle.py. Quick GPU check of the carried vLLM core custom-op library:
#   PYTHONPATH=/tmp/site python3 @@OUTREL@@/smoke_kernels.py
import torch
import vllm._C_stable_libtorch  # noqa: F401
from vllm import _custom_ops as ops

x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)
torch.cuda.synchronize()
print("rms_norm max abs err:", (out.float() - ref.float()).abs().max().item())
assert torch.allclose(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
print("core kernels OK on", torch.cuda.get_device_name())
'''

TEST_ENV = "PYTHONPATH=/tmp/site:$PWD RLMEGA_TEST_ATTENTION_BACKEND=TRITON_ATTN VLLM_USE_FLASHINFER_SAMPLER=0"


def log(msg: str) -> None:
    print(f"[make_bundle] {msg}", flush=True)


def die(msg: str) -> None:
    sys.exit(f"[make_bundle] ERROR: {msg}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MiB), b""):
            h.update(chunk)
    return h.hexdigest()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


# ------------------------------------------------------------------------------------------------ downloads
def fetch_wheels(wheels, wheel_dir: Path, offline: bool) -> None:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = []
    for req, name, want in wheels:
        p = wheel_dir / name
        if p.exists() and sha256(p) == want:
            continue
        if p.exists():
            log(f"cached {name} has the wrong sha256: downloading it again")
            p.unlink()
        missing.append((req, name, want))
    if not missing:
        log(f"all {len(wheels)} wheels cached in {wheel_dir}")
        return
    if offline:
        die("--offline but not cached: " + ", ".join(n for _, n, _ in missing))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(wheel_dir),
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
        "--abi",
        "abi3",
        "--abi",
        "none",
        # pip 23 does not widen manylinux_2_28 to the older tags: name 2014 too (it widens that to 2010, 1)
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux_2_26_x86_64",
        "--platform",
        "manylinux_2_24_x86_64",
        "--platform",
        "manylinux2014_x86_64",
    ]
    cmd += [req for req, _, _ in missing]
    log("downloading " + " ".join(req for req, _, _ in missing))
    subprocess.run(cmd, check=True)
    for req, name, want in missing:
        p = wheel_dir / name
        if not p.exists():
            found = sorted(
                x.name for x in wheel_dir.glob(re.split(r"[=<>]", req)[0].replace("-", "_") + "-*")
            )
            die(
                f"pip download {req} did not give {name} (found: {found}); the index serves another file now"
            )
        got = sha256(p)
        if got != want:
            die(
                f"{name}: sha256 {got} != expected {want} (not the wheel the bundle was proven with)"
            )


# ------------------------------------------------------------------------------------------------ trees
def _stripped(name: str, files: list[str], dirs: list[str]) -> str | None:
    if "/__pycache__/" in name or name.startswith("__pycache__/"):
        return "__pycache__"
    if name in files:
        return name
    for d in dirs:
        if name.startswith(d):
            return d
    return None


def stage_tree(
    wheel: Path, tree: Path, files: list[str], dirs: list[str], must_keep: list[str]
) -> dict:
    """Unpack ``wheel`` into ``tree`` less ``files`` and ``dirs`` (each rule must match something, every
    ``must_keep`` file must be there; else the script stops). Returns {rule: [files, bytes]} removed."""
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    hits = {k: [0, 0] for k in files + dirs}
    kept = kept_bytes = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if info.is_dir():
                continue
            if name.startswith("/") or ".." in name.split("/"):
                die(f"unsafe path in wheel: {name}")
            rule = _stripped(name, files, dirs)
            if rule is not None:
                if rule in hits:
                    hits[rule][0] += 1
                    hits[rule][1] += info.file_size
                continue
            dest = tree / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, MiB)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(dest, mode if mode else 0o644)  # Ray's gcs_server and raylet stay executable
            kept += 1
            kept_bytes += info.file_size
    unmatched = [k for k, (n, _) in hits.items() if n == 0]
    if unmatched:
        die(f"strip rules that match nothing in {wheel.name} (the wheel changed?): {unmatched}")
    for k in must_keep:
        if not (tree / k).is_file():
            die(f"{k} missing from the staged tree")
    log(
        f"{tree.name}: kept {kept} files, {kept_bytes / MiB:.1f} MiB; removed "
        f"{sum(b for _, b in hits.values()) / MiB:.1f} MiB"
    )
    return hits


# ------------------------------------------------------------------------------------------------ closure
def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path) -> list[str]:
    """Names of what ``wheel`` requires on Python 3.12, Linux x86_64 (extras and other markers' lines left out)."""
    try:
        from packaging.markers import Marker
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.markers import Marker
    env = {
        "python_version": "3.12",
        "python_full_version": "3.12.3",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": "",
    }
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req, _, marker = line.removeprefix("Requires-Dist:").partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate(env):
            continue
        out.append(_norm(re.split(r"[\s\[<>=!~(]", req.strip(), maxsplit=1)[0]))
    return out


def check_closure(
    wheel_dir: Path,
    wheels: list[tuple[str, str, str]],
    core: list[str],
    machine: set[str] = MACHINE_PACKAGES,
) -> None:
    """Every package `rlmega train` needs is on the machine or carried: setup.py's CORE requirements, and each
    carried wheel's own requirements; vLLM's, except exactly the ones VLLM_LEFT_OUT names. Names only (the
    machine's versions are not listed). Stops with what is missing."""
    have = {_norm(n) for n in machine} | {_norm(re.split(r"[=<>]", req)[0]) for req, _, _ in wheels}
    missing = {}
    for req in core:
        name = _norm(re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0])
        if name not in have:
            missing.setdefault("setup.py CORE", []).append(name)
    for req, file, _ in wheels:
        names = requirements(wheel_dir / file)
        if file == VLLM_WHEEL[1]:
            absent = {n for n in names if n not in have}
            left = {_norm(n) for n in VLLM_LEFT_OUT}
            if absent != left:
                die(
                    f"vLLM's requirements and VLLM_LEFT_OUT drifted apart: not carried and not listed: "
                    f"{sorted(absent - left)}; listed but now carried or gone: {sorted(left - absent)}"
                )
            continue
        lack = [n for n in names if n not in have]
        if lack:
            missing[req] = lack
    if missing:
        die(
            "neither on the GPU machine (MACHINE_PACKAGES) nor carried: "
            + "; ".join(f"{k} needs {', '.join(v)}" for k, v in missing.items())
            + ". Add their wheels to RUN_WHEELS"
        )
    log(
        f"closure: setup.py's CORE and every carried wheel's requirements are on the machine or carried "
        f"({len(VLLM_LEFT_OUT)} of vLLM's left out on purpose)"
    )


def setup_core(repo: Path) -> list[str]:
    """setup.py's CORE requirement strings (read, not imported: importing it runs setup())."""
    text = (repo / "setup.py").read_text()
    block = re.search(r"^CORE = \[(.*?)^\]", text, re.S | re.M)
    if block is None:
        die("setup.py has no CORE = [...] list")
    return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", block.group(1)))


def apply_patches(tree: Path) -> None:
    for rel, old, new in PATCHES:
        p = tree / rel
        if not p.is_file():
            die(f"patch target {rel} is missing")
        text = p.read_text(encoding="utf-8")
        n = text.count(old)
        if n != 1:
            die(f"patch target text found {n} times (expected exactly 1) in {rel}:\n{old}")
        text = text.replace(old, new, 1)
        compile(text, str(p), "exec")  # a patch must leave valid Python
        p.write_text(text, encoding="utf-8")
        log(f"patched {rel}")


# ------------------------------------------------------------------------------------------------ bundle
def _tarinfo(path: Path, arcname: str) -> tarfile.TarInfo:
    st = path.stat()
    ti = tarfile.TarInfo(arcname)
    ti.mtime = TAR_MTIME
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    if path.is_dir():
        ti.type = tarfile.DIRTYPE
        ti.mode = 0o755
    else:
        ti.size = st.st_size
        ti.mode = 0o755 if st.st_mode & 0o111 else 0o644
    return ti


def stage_entries(stage: Path) -> list[Path]:
    out = []
    for top in ("README.md", "wheels", "vllm_tree", "ray_tree"):
        p = stage / top
        out.append(p)
        if p.is_dir():
            out.extend(sorted(p.rglob("*"), key=lambda q: q.relative_to(stage).as_posix()))
    return out


def fingerprint(stage: Path, preset: int) -> str:
    h = hashlib.sha256(f"preset={preset};mtime={TAR_MTIME}\n".encode())
    for p in stage_entries(stage):
        ti = _tarinfo(p, p.relative_to(stage).as_posix())
        h.update(f"{ti.name}\0{ti.mode}\0{ti.size}\0".encode())
        if p.is_file():
            h.update(sha256(p).encode())
    return h.hexdigest()


def write_bundle(stage: Path, dest: Path, preset: int) -> None:
    tmp = dest.with_suffix(".tmp")
    with lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=preset) as xz:
        with tarfile.open(fileobj=xz, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for p in stage_entries(stage):
                ti = _tarinfo(p, p.relative_to(stage).as_posix())
                if p.is_dir():
                    tar.addfile(ti)
                else:
                    with open(p, "rb") as f:
                        tar.addfile(ti, f)
    tmp.replace(dest)


def split(bundle: Path, out: Path, part_bytes: int) -> list[tuple[Path, int, str]]:
    for old in out.glob("part*"):
        if old.is_dir() and re.fullmatch(r"part\d+", old.name):
            shutil.rmtree(old)
    parts = []
    with open(bundle, "rb") as f:
        k = 0
        while True:
            chunk = f.read(part_bytes)
            if not chunk:
                break
            d = out / f"part{k + 1}"
            d.mkdir(parents=True)
            p = d / f"bundle.tar.xz.{k:03d}"
            p.write_bytes(chunk)
            parts.append((p, len(chunk), hashlib.sha256(chunk).hexdigest()))
            k += 1
    return parts


def ensure_excluded(repo: Path, out: Path) -> None:
    rel = out.relative_to(repo).as_posix()
    exclude = Path(git(repo, "rev-parse", "--git-path", "info/exclude").strip())
    if not exclude.is_absolute():
        exclude = repo / exclude
    pattern = f"/{rel}/"
    raw = exclude.read_text() if exclude.exists() else ""
    if pattern not in raw.splitlines():
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with open(exclude, "a") as f:
            f.write(("" if raw == "" or raw.endswith("\n") else "\n") + pattern + "\n")
        log(f"added {pattern} to {exclude}")
    probe = f"{rel}/part1/probe"
    if subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", probe]).returncode != 0:
        die(f"{rel}/ is not git-ignored")


def worktree_bytes(repo: Path) -> int:
    names = git(repo, "ls-files", "-co", "--exclude-standard", "-z").split("\0")
    total = 0
    for n in names:
        p = repo / n
        if n and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


# The proof list's environment on the GPU machine: the carry first on the path; vLLM's Triton attention (no
# flash-attention libraries carried) and PyTorch sampler (no flashinfer).
PROVE_ENV = "PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1"
PROVE = "python3 tools/gpu/prove.py --attention-backend TRITON_ATTN --out $OUT"
GPU_TESTS = (
    f"set -o pipefail; export {TEST_ENV} && python3 -m pytest tests/gpu -p no:cacheprovider --durations=15"
    " 2>&1 | tee $OUT/pytest_gpu.log"
)


def calls(
    outrel: str, nparts: int, steps: str, start: str | None = None
) -> list[tuple[list[str], str, int]]:
    """(carry, command, timeout_s) of each device call, in order: every part's call copies its part (the first
    also says what the machine has); the last part's installs everything and starts tools/gpu/prove.py on
    ``steps`` (from ``start``: where the last lease stopped, docs/gpu.md) with a 560 s deadline; one more call
    goes on from where that one stopped, with what the lease has left (its --from and timeout are filled in
    then, from summary.json's next_step and `status`)."""
    begin = f" --from {start}" if start else ""
    seq = []
    for k in range(1, nparts):
        copy = f"mkdir -p /tmp/w && cp {outrel}/part{k}/* /tmp/w/ && ls -l /tmp/w"
        if k == 1:
            copy += " && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv && df -h /tmp /dev/shm"
        seq.append(([f"{outrel}/part{k}"], copy, 120))
    install = (
        f"set -o pipefail; mkdir -p /tmp/w && cp {outrel}/part{nparts}/* /tmp/w/ && bash {outrel}/install.sh"
        f" && export {PROVE_ENV} && python3 {outrel}/smoke_kernels.py && {PROVE} --steps {steps}{begin}"
        f" --deadline-s 560 2>&1 | tee $OUT/prove.log"
    )
    seq.append(
        (
            [f"{outrel}/part{nparts}", f"{outrel}/install.sh", f"{outrel}/smoke_kernels.py"],
            install,
            600,
        )
    )
    seq.append(
        (
            [],
            f"set -o pipefail; export {PROVE_ENV} && {PROVE} --steps {steps} --from NEXT --deadline-s "
            f"LEFT-40 2>&1 | tee $OUT/prove.log",
            "LEFT",
        )
    )
    return seq


def main() -> None:
    repo_default = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--repo", type=Path, default=repo_default, help="rlmega checkout (default: this script's)"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder inside the repo (default: <repo>/.gpucarry)",
    )
    ap.add_argument(
        "--cache", type=Path, default=None, help="download/staging cache (default: <out>/cache)"
    )
    ap.add_argument(
        "--moe",
        action="store_true",
        help="keep vLLM's MoE kernels (47 MB, ~39 MiB compressed: one part "
        "more) for prove.py's step d",
    )
    ap.add_argument(
        "--part-mib",
        type=float,
        default=0.0,
        help="largest part, MiB (default: what a call takes beside the working tree, less 2 MiB)",
    )
    ap.add_argument(
        "--xz-preset", type=int, default=9, help="xz preset (default 9: 64 MiB dictionary)"
    )
    ap.add_argument("--offline", action="store_true", help="do not run pip: use cached wheels only")
    ap.add_argument(
        "--from",
        dest="start",
        default=None,
        help="the step the install call's prove.py starts at: where the last lease stopped (docs/gpu.md)",
    )
    args = ap.parse_args()

    repo = Path(git(args.repo, "rev-parse", "--show-toplevel").strip()).resolve()
    out = (args.out or repo / ".gpucarry").resolve()
    try:
        outrel = out.relative_to(repo).as_posix()
    except ValueError:
        die(f"--out {out} must be inside the repo {repo} (device calls carry repo-relative paths)")
    cache = (args.cache or out / "cache").resolve()
    out.mkdir(parents=True, exist_ok=True)
    ensure_excluded(repo, out)

    # 1. wheels, and the proof that they and the machine hold everything
    wheel_dir = cache / "wheels"
    carried = VLLM_DEP_WHEELS + TRAINER_WHEELS + RUN_WHEELS
    fetch_wheels([VLLM_WHEEL, RAY_WHEEL] + carried, wheel_dir, args.offline)
    check_closure(wheel_dir, [VLLM_WHEEL, RAY_WHEEL] + carried, setup_core(repo))

    # 2. stage: README.md, wheels/ (+SHA256SUMS), vllm_tree/, ray_tree/
    stage = cache / ("stage_moe" if args.moe else "stage")
    if stage.exists():
        shutil.rmtree(stage)
    (stage / "wheels").mkdir(parents=True)
    strip_files = [f for f in STRIP_FILES if not (args.moe and f == MOE_KERNELS)]
    hits = stage_tree(
        wheel_dir / VLLM_WHEEL[1],
        stage / "vllm_tree",
        strip_files,
        STRIP_DIRS,
        MUST_KEEP + ([MOE_KERNELS] if args.moe else []),
    )
    ray_hits = stage_tree(
        wheel_dir / RAY_WHEEL[1], stage / "ray_tree", [], RAY_STRIP_DIRS, RAY_MUST_KEEP
    )
    apply_patches(stage / "vllm_tree")
    sums = []
    for _, name, want in sorted(carried, key=lambda w: w[1]):
        shutil.copy2(wheel_dir / name, stage / "wheels" / name)
        sums.append(f"{want}  {name}\n")
    (stage / "wheels" / "SHA256SUMS").write_text("".join(sums))
    lines = lambda h: "\n".join(f"- {k} ({n} files, {b / 1e6:.1f} MB)" for k, (n, b) in h.items())  # noqa: E731
    (stage / "README.md").write_text(
        BUNDLE_README.format(
            moe_title=", with MoE kernels" if args.moe else ", dense models only",
            strip=lines(hits),
            ray_strip=lines(ray_hits),
            deps=", ".join(r for r, _, _ in VLLM_DEP_WHEELS) + ".",
            trainer=", ".join(r for r, _, _ in TRAINER_WHEELS) + ".",
            run=", ".join(r for r, _, _ in RUN_WHEELS) + ".",
        )
    )

    # 3. bundle (recompressed only when the staged content changed)
    bundle = cache / ("bundle_moe.tar.xz" if args.moe else "bundle.tar.xz")
    fp_file = bundle.with_suffix(".fingerprint")
    fp = fingerprint(stage, args.xz_preset)
    if bundle.exists() and fp_file.exists() and fp_file.read_text().strip() == fp:
        log(f"staged content unchanged: reusing {bundle}")
    else:
        log(f"compressing (xz preset {args.xz_preset}; a few minutes) ...")
        write_bundle(stage, bundle, args.xz_preset)
        fp_file.write_text(fp + "\n")
    size, digest = bundle.stat().st_size, sha256(bundle)
    log(f"{bundle.name}: {size:,} bytes ({size / MiB:.1f} MiB), sha256 {digest}")

    # 4. parts (as few as fit a call beside the working tree, of equal size) + install.sh + smoke_kernels.py + CALLS.md
    tree = worktree_bytes(repo)
    room = DEVICE_CARRY_LIMIT - tree - 2 * MiB - 64 * 1024  # install.sh, smoke_kernels.py and slack
    limit = int(args.part_mib * MiB) if args.part_mib else room
    if limit > room:
        die(
            f"--part-mib {args.part_mib} leaves no room for the working tree ({tree / MiB:.1f} MiB) in a 64 MiB call"
        )
    nparts = -(-size // limit)
    parts = split(bundle, out, -(-size // nparts))
    for p, n, _ in parts:
        log(f"{p.relative_to(repo)}: {n:,} bytes ({n / MiB:.1f} MiB)")
    old_trainer = out / "trainer"  # (an older layout's folder; the bundle holds those wheels)
    if old_trainer.exists():
        shutil.rmtree(old_trainer)
    part_lines = "\n".join(f'  "{p.name} {n} {h}"' for p, n, h in parts)
    install = (
        INSTALL_SH.replace("@@VLLM_VERSION@@", VLLM_VERSION)
        .replace("@@OUTREL@@", outrel)
        .replace("@@SIZE@@", str(size))
        .replace("@@SHA@@", digest)
        .replace("@@PARTS@@", part_lines)
    )
    (out / "install.sh").write_text(install)
    os.chmod(out / "install.sh", 0o755)
    (out / "smoke_kernels.py").write_text(SMOKE_PY.replace("@@OUTREL@@", outrel))

    steps = "a,b,c,d,e" if args.moe else "a,b,c,e"
    seq = calls(outrel, len(parts), steps, args.start)
    lines = [
        f"# Device calls for bundle {digest[:16]} ({size / MiB:.1f} MiB in {len(parts)} parts; "
        f"working tree {tree / MiB:.1f} MiB){' with MoE kernels' if args.moe else ''}",
        "# Issue them back to back: /tmp/w lives only while the machine stays warm (~30 s idle).",
        f"# Call {len(parts)} installs the carry and starts tools/gpu/prove.py (steps {steps}"
        f"{', from ' + args.start if args.start else ''}); call "
        f"{len(parts) + 1} goes on from summary.json's next_step.",
        "",
    ]
    for i, (carry, cmd, timeout) in enumerate(seq, 1):
        if len(cmd) > 2000:
            die(f"call {i} command is {len(cmd)} characters (the device takes at most 2000)")
        lines.append(f"call {i}/{len(seq)}: run(carry={json.dumps(carry)}, timeout_s={timeout},")
        lines.append(f"          command={json.dumps(cmd)})")
    lines += [
        "",
        f"Call {len(seq)}: NEXT is summary.json's next_step of call {len(seq) - 1} (none: every step "
        "passed, skip it); LEFT is `status`'s budget_left_s less 30 (the give-back).",
        "A step it does not reach is where the next lease starts (docs/gpu.md). Repeating an install call on "
        "the same warm machine skips the install (install.sh sees the bundle's sha256 in /tmp/site).",
        "Then give_back unless you run more at once.",
        "",
        "If a warm machine still has time after the proof list (../shared/GPU.md item 2), the GPU tests:",
        f"run(carry=[], timeout_s=LEFT, command={json.dumps(GPU_TESTS)})",
    ]
    text = "\n".join(lines) + "\n"
    (out / "CALLS.md").write_text(text)
    print()
    print(text, end="")


if __name__ == "__main__":
    main()

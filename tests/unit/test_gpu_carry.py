"""tools/gpu/make_bundle.py's proof that the GPU machine gets everything `rlmega train` imports: setup.py's CORE
requirements and every carried wheel's own are on the machine (MACHINE_PACKAGES) or in the bundle.

The wheels themselves are not downloaded here (290 MiB): their requirement lists are checked by the script when
it builds the bundle; these tests hold the rules on small wheels made on the spot, and setup.py's real list.
"""

import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))
import make_bundle as mb  # noqa: E402


def _wheel(folder: Path, name: str, requires: list[str]) -> tuple[str, str, str]:
    file = f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(folder / file, "w") as z:
        meta = "Metadata-Version: 2.1\nName: " + name + "\nVersion: 1.0\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr(f"{name.replace('-', '_')}-1.0.dist-info/METADATA", meta)
    return (f"{name}==1.0", file, "0" * 64)


def test_setup_py_core_is_on_the_gpu_machine_or_carried():
    """A CORE dependency added to setup.py that the machine lacks fails here until make_bundle carries it."""
    core = mb.setup_core(ROOT)
    assert "ray==2.60.0" in core and any(r.startswith("math-verify") for r in core)
    carried = {
        mb._norm(r.split("==")[0])
        for r, _, _ in [mb.VLLM_WHEEL, mb.RAY_WHEEL]
        + mb.VLLM_DEP_WHEELS
        + mb.TRAINER_WHEELS
        + mb.RUN_WHEELS
    }
    have = carried | {mb._norm(n) for n in mb.MACHINE_PACKAGES}
    names = {mb._norm(r.split("==")[0].split(">=")[0].split("<")[0]) for r in core}
    assert names - have == set(), (
        f"setup.py CORE needs {names - have}: neither on the GPU machine nor carried"
    )


def test_a_missing_requirement_stops_the_bundle_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(mb, "VLLM_WHEEL", ("vllm==0", "none.whl", ""))
    wheels = [
        _wheel(
            tmp_path,
            "carried-a",
            [
                "numpy",
                "carried-b>=2",
                "absent-c; python_version >= '3.8'",
                "old-d; python_version < '3.5'",
                "extra-e; extra == 'dev'",
            ],
        ),
        _wheel(tmp_path, "carried-b", []),
    ]
    with pytest.raises(SystemExit, match="carried-a==1.0 needs absent-c"):
        mb.check_closure(tmp_path, wheels, ["numpy"], machine={"numpy"})
    wheels.append(_wheel(tmp_path, "absent-c", []))
    # markers that do not apply are left out
    mb.check_closure(tmp_path, wheels, ["numpy"], machine={"numpy"})
    with pytest.raises(SystemExit, match="setup.py CORE needs uvicorn"):
        mb.check_closure(tmp_path, wheels, ["numpy", "uvicorn>=0.30"], machine={"numpy"})


def test_vllms_left_out_list_must_match_what_is_not_carried(tmp_path, monkeypatch):
    vllm = _wheel(tmp_path, "vllm", ["numpy", "blake3", "xgrammar<1"])
    monkeypatch.setattr(mb, "VLLM_WHEEL", vllm)
    monkeypatch.setattr(mb, "VLLM_LEFT_OUT", {"blake3": "hashing", "xgrammar": "grammars"})
    mb.check_closure(tmp_path, [vllm], [], machine={"numpy"})
    # vLLM grew a requirement nobody looked at
    monkeypatch.setattr(mb, "VLLM_LEFT_OUT", {"blake3": "hashing"})
    with pytest.raises(SystemExit, match=r"not carried and not listed: \['xgrammar'\]"):
        mb.check_closure(tmp_path, [vllm], [], machine={"numpy"})


def test_the_printed_calls_fit_the_device_tool():
    seq = mb.calls(".gpucarry", 2, "a,b,c,e")
    assert [c[0] for c in seq] == [
        [".gpucarry/part1"],
        [".gpucarry/part2", ".gpucarry/install.sh", ".gpucarry/smoke_kernels.py"],
        [],
    ]
    assert all(len(cmd) <= 2000 for _, cmd, _ in seq)
    assert "install.sh" in seq[1][1] and "prove.py" in seq[1][1] and "--steps a,b,c,e" in seq[1][1]
    assert "--from NEXT" in seq[2][1] and seq[1][2] == 600 and "--from" not in seq[1][1]
    # the next lease starts where the last one stopped (docs/gpu.md): make_bundle.py --from b
    assert (
        "--steps a,b,c,e --from b --deadline-s 560"
        in mb.calls(".gpucarry", 2, "a,b,c,e", "b")[1][1]
    )

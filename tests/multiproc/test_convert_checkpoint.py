"""tools/convert_checkpoint.py end to end: HF -> Megatron dist checkpoint in one layout (torchrun)
-> HF in another (e.g. TP2 -> plain-python TP1) gives back the same tensors bit for bit, and bad
arguments fail fast with a message instead of a traceback.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlmega.demo.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TOOL = str(REPO / "tools" / "convert_checkpoint.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(
    args: list[str], torchrun_ranks: int | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if torchrun_ranks:
        launcher += [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(torchrun_ranks),
        ]
    return subprocess.run(
        launcher + [TOOL, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def _hf_state(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# (model kwargs, hf-to-mcore layout, mcore-to-hf layout); ranks = TP x PP, 1 = plain python.
CASES = {
    "qwen2_tp2_to_tp1": (dict(arch="qwen2"), ["--tp", "2"], []),
    # Tied head, odd vocabulary (130 -> 256 rows), the head's copy on the last of 4 virtual stages.
    "llama_tied_pp2vpp2_to_tp2": (
        dict(arch="llama", tie_word_embeddings=True, vocab_size=130),
        ["--pp", "2", "--vpp", "2"],
        ["--tp", "2"],
    ),
    # MoE: q/k norms, a router and 8 experts a layer (per-expert HF names), TP-split experts.
    "qwen3_moe_tp2_to_tp1": (dict(arch="qwen3_moe", num_experts=8, top_k=2), ["--tp", "2"], []),
}


def _ranks(layout: list[str]) -> int | None:
    sizes = dict(zip(layout[::2], map(int, layout[1::2])))
    n = sizes.get("--tp", 1) * sizes.get("--pp", 1)
    return n if n > 1 else None


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_mcore_to_hf_in_another_layout_is_bit_identical(tmp_path, case):
    model_kw, save_layout, load_layout = CASES[case]
    hf = make_tiny_model(
        tmp_path / "hf",
        hidden_size=128,
        num_heads=2,
        num_kv_heads=2,
        num_layers=4,
        seed=11,
        **model_kw,
    )
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"

    r = _run(
        ["hf-to-mcore", "--hf", str(hf), "--out", str(ckpt), *save_layout],
        torchrun_ranks=_ranks(save_layout),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"wrote {ckpt / 'step_00000000'}" in r.stdout and "parameters" in r.stdout
    assert (ckpt / "latest").read_text().strip() == "step_00000000"

    r = _run(
        [
            "mcore-to-hf",
            "--ckpt",
            str(ckpt),
            "--hf-config-from",
            str(hf),
            "--out",
            str(back),
            *load_layout,
        ],
        torchrun_ranks=_ranks(load_layout),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"wrote {back}" in r.stdout

    original, exported = _hf_state(hf), _hf_state(back)
    assert sorted(exported) == sorted(original)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype and torch.equal(exported[name], value), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (back / name).read_bytes() == (hf / name).read_bytes()

    # transformers loads the result and computes what the original computes.
    ids = torch.randint(0, 59, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(back).eval()(ids).logits
    assert torch.equal(got, ref)


@pytest.mark.parametrize(
    "args, named",
    [
        (
            ["hf-to-mcore", "--hf", "{tmp}/no_such_model", "--out", "{tmp}/ckpt"],
            "{tmp}/no_such_model",
        ),
        (
            [
                "mcore-to-hf",
                "--ckpt",
                "{tmp}/no_such_ckpt",
                "--hf-config-from",
                "{tmp}",
                "--out",
                "{tmp}/o",
            ],
            "{tmp}/no_such_ckpt",
        ),
        (["hf-to-mcore", "--hf", "{tmp}", "--out", "{tmp}/ckpt"], "no config.json"),
    ],
)
def test_bad_arguments_fail_fast_with_a_message(tmp_path, args, named):
    r = _run([a.format(tmp=tmp_path) for a in args], timeout=60)
    assert r.returncode != 0
    assert named.format(tmp=tmp_path) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "o").exists()


def test_more_ranks_than_one_python_process_is_a_clear_error(tmp_path):
    hf = make_tiny_model(
        tmp_path / "hf", hidden_size=128, num_heads=2, num_kv_heads=2, num_layers=4
    )
    r = _run(
        ["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "ckpt"), "--tp", "2"], timeout=60
    )
    assert r.returncode != 0 and "torchrun" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = _run(
        ["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "ckpt"), "--pp", "3"], timeout=60
    )
    assert r.returncode != 0 and "num_hidden_layers=4" in r.stderr, r.stderr

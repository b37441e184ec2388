"""A RolloutWorker serving LoRA adapters unmerged (rlmega/rollout/lora_serving.py) on a real vLLM engine.

One engine (lora_rank 8) in a fresh process: adapter v1 loaded, samples drawn; a long request in flight cut
by a sync that loads v2 (pause with abort, load, resume); the base reloaded with other weights, then v1
again. transformers + peft score the same tokens here: each token's log-prob must be the one of the
adapter (and base) of the version the engine says it was sampled with.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlmega.testing.multiproc import run_on_ranks
from rlmega.demo.tiny_model import make_tiny_model

PROMPTS = [[1, 5, 7, 9, 11], [1, 20, 21]]
FILES = ("adapter_config.json", "adapter_model.safetensors")
# measured: 4.8e-7 for each check below (vLLM vs transformers + peft, float32); 1e-5: the parity tests' limit
LIMIT = 1e-5


def _adapter(base: str, out: Path, seed: int) -> str:
    """A rank-8 PEFT adapter of ``base`` on every projection, B random (peft starts it at 0: no effect)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
            task_type="CAUSAL_LM",
        ),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return str(out)


def _body(model_dir: str, v1: str, v2: str, base2: dict) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from rlmega.rollout.rollout import RolloutWorker

    files = {d: {n: Path(d, n).read_bytes() for n in FILES} for d in (v1, v2)}
    w = RolloutWorker(model_dir, max_model_len=256, seed=0, kv_cache_space_gb=0.5, lora_rank=8)
    out = {}
    try:
        w.load_adapter(files[v1], version=1)
        out["v1"] = [
            vars(s) for s in w.generate(PROMPTS, n=2, max_tokens=16, ignore_eos=True, seed=1)
        ]
        # a long request, cut by a sync that loads v2, resumed on it
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(w.generate_one, PROMPTS[0], max_tokens=200, ignore_eos=True, seed=2)
            deadline = time.monotonic() + 60
            while w.num_outstanding() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            out["cut"] = w.pause_generation(abort_in_flight=True)
            w.load_adapter(files[v2], version=2)
            w.resume_generation()
            out["long"] = vars(long.result())
        # another base (drops vLLM's adapters), then v1 on it
        w.update_weights(base2.items(), version=3)
        w.load_adapter(files[v1], version=3)
        out["base2_v1"] = [
            vars(s) for s in w.generate(PROMPTS, n=1, max_tokens=16, ignore_eos=True, seed=3)
        ]
        out["version"] = w.weight_version()
    finally:
        w.shutdown()
    return out


def _scores(base: str, adapter: str, sample: dict, state: dict | None = None) -> torch.Tensor:
    """transformers + peft: the log-prob of each sampled token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)
    model = PeftModel.from_pretrained(model, adapter).eval()
    ids = sample["prompt_ids"] + sample["response_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    p = len(sample["prompt_ids"])
    return lp[p - 1 : -1].gather(-1, torch.tensor(sample["response_ids"])[:, None])[:, 0]


def test_adapters_served_unmerged_swap_in_flight_and_survive_a_base_reload(tmp_path):
    base = str(
        make_tiny_model(
            tmp_path / "m", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2, seed=1
        )
    )
    v1, v2 = _adapter(base, tmp_path / "v1", 1), _adapter(base, tmp_path / "v2", 2)
    from safetensors.torch import load_file

    base2 = {
        k: v * 1.05 if k.endswith("mlp.down_proj.weight") else v
        for k, v in load_file(f"{base}/model.safetensors").items()
    }
    out = run_on_ranks(_body, 1, args=(base, v1, v2, base2), timeout_s=300)[0]

    worst = max(
        float((torch.tensor(s["logprobs"]) - _scores(base, v1, s)).abs().max()) for s in out["v1"]
    )
    print("v1 vs transformers + peft", worst)
    assert worst <= LIMIT
    long = out["long"]
    versions = torch.tensor(long["token_versions"])
    assert out["cut"] == 1 and long["resumes"] == 1 and set(versions.tolist()) == {1, 2}, long[
        "token_versions"
    ]
    got = torch.tensor(long["logprobs"])
    for version, adapter in ((1, v1), (2, v2)):
        mine = versions == version
        diff = float((got[mine] - _scores(base, adapter, long)[mine]).abs().max())
        other = float(
            (got[mine] - _scores(base, v2 if version == 1 else v1, long)[mine]).abs().max()
        )
        print(
            f"cut request, tokens of version {version}: {diff:.2e} (the other adapter: {other:.2e})"
        )
        assert diff <= LIMIT < other
    worst = max(
        float((torch.tensor(s["logprobs"]) - _scores(base, v1, s, base2)).abs().max())
        for s in out["base2_v1"]
    )
    off = max(
        float((torch.tensor(s["logprobs"]) - _scores(base, v1, s)).abs().max())
        for s in out["base2_v1"]
    )
    print(f"v1 on the reloaded base: {worst:.2e} (on the old base: {off:.2e})")
    assert worst <= LIMIT < off and out["version"] == 3

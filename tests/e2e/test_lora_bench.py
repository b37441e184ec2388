"""tools/bench/lora.py --smoke: LoRA's weight sync and trainer memory against full-parameter training run end
to end (the FSDP learner and a real vLLM engine serving the adapters; the Megatron learner on Ray at TP1 with an
engine actor) in seconds, so the benchmark cannot rot, and its JSON holds the numbers issue 41 asks for."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lora_bench_smoke_reports_sync_ratio_and_memory(tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/lora.py"), "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    s, mem = r["sync"], r["memory"]
    # the adapters alone
    assert s["bytes"]["full"] == s["bytes"]["merged"] > 10 * s["bytes"]["lora"] > 0
    assert (
        abs(s["ratio"] - s["lora_s"] / s["full_s"]) < 1e-12 and 0 < s["lora_s"] and 0 < s["full_s"]
    )
    assert r["verdict"] in ("PASS", "MISS") and "LoRA/full" in proc.stdout
    full, lora = mem["full"], mem["lora"]
    assert lora["reference"] == 0 < full["reference"] == full["params"]  # no second model
    # float32, every weight
    assert full["grads"] == full["params"] and full["adam"] == 2 * full["params"]
    # the adapters alone
    assert 0 < lora["grads"] < full["grads"] / 10 and lora["adam"] == 2 * lora["grads"]
    assert lora["params"] == full["params"] + lora["grads"]  # the base and the adapters
    (m,) = r["megatron"]  # the Megatron learner's row (TP1 in the smoke run; TP2 x PP2 by default)
    assert m["layout"] == "TP1xPP1" and m["bytes"]["full"] > 10 * m["bytes"]["lora"] > 0
    # the same adapters' files as the FSDP learner's
    assert m["bytes"]["lora"] == s["bytes"]["lora"]
    assert abs(m["ratio"] - m["lora_s"] / m["full_s"]) < 1e-12 and m["verdict"] in ("PASS", "MISS")

"""tools/bench/train_step.py --smoke: rlmega's train step against a plain transformers step runs end to end
(a real Megatron rank, a real transformers model) in seconds, so the benchmark cannot rot, and its JSON
holds what issue 12 asks for: tokens/s of both sides and their ratio, from interleaved rounds."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_step_smoke_reports_tokens_per_second_of_both_sides(tmp_path):
    out = tmp_path / "ts.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools/bench/train_step.py"), "--smoke", "--threads", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["smoke"] and r["threads"] == 1 and r["tokens"] > 0
    for side in ("rlmega", "transformers"):
        assert len(r["seconds"][side]) == 2 and all(s > 0 for s in r["seconds"][side])  # the warm-up dropped
        assert abs(r["tokens_per_s"][side] - r["tokens"] / r["median_s"][side]) < 1e-6
    assert abs(r["ratio"] - r["tokens_per_s"]["rlmega"] / r["tokens_per_s"]["transformers"]) < 1e-9
    assert r["verdict"] == ("PASS" if r["ratio"] >= 1.0 else "MISS")
    assert f"= {r['ratio']:.2f}  (target >= 1.0: {r['verdict']})" in proc.stdout

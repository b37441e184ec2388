"""tools/bench/train_step.py --smoke: rlmega's train step on both learners (a real Megatron rank and a real
FSDP2 actor, sharing one gloo group) against a plain transformers step runs end to end in seconds, so the
benchmark cannot rot, and its JSON holds what issues 12 and 23 ask for: tokens/s of the three sides from
the same interleaved rounds, and the ratios megatron / transformers and fsdp / transformers."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIDES = ["megatron", "fsdp", "transformers"]


def test_train_step_smoke_reports_tokens_per_second_of_three_sides(tmp_path):
    out = tmp_path / "ts.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/bench/train_step.py"),
            "--smoke",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["smoke"] and r["threads"] == 1 and r["tokens"] > 0 and r["rounds"] == 2
    assert r["sides"] == SIDES and sorted(r["seconds"]) == sorted(SIDES)
    for side in SIDES:
        # the warm-up dropped
        assert len(r["seconds"][side]) == 2 and all(s > 0 for s in r["seconds"][side])
        assert abs(r["tokens_per_s"][side] - r["tokens"] / r["median_s"][side]) < 1e-6
    assert sorted(r["ratios"]) == ["fsdp", "megatron"]
    for side, ratio in r["ratios"].items():
        assert abs(ratio - r["tokens_per_s"][side] / r["tokens_per_s"]["transformers"]) < 1e-9
        assert r["verdicts"][side] == ("PASS" if ratio >= 1.0 else "MISS")
        assert (
            f"ratio {side} / transformers tokens/s = {ratio:.2f}  (target >= 1.3: {r['verdicts'][side]})"
            in proc.stdout
        )

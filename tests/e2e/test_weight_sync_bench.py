"""tools/bench/weight_sync.py --smoke: the weight-sync benchmark runs end to end (a real vLLM engine, a
real Megatron rank on Ray) in seconds, so it cannot rot again (it raised NameError before)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_weight_sync_smoke_runs_and_reports_every_part(tmp_path):
    out = tmp_path / "ws.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools/bench/weight_sync.py"), "--smoke", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["model"]["params"] == 1_837_312  # the smoke shape: hidden 256, 2 layers, vocab 512, untied
    (layout,) = r["layouts"]
    assert "object store" in proc.stdout and "TP1xPP1" in proc.stdout
    text = json.dumps(layout)
    for part in ("sync_s", "gather_s", "engine_s"):
        assert part in text, part

"""The long-context benchmarks' smoke modes: tools/bench/long_context.py (both heads' train-pass memory at 512
tokens over a 151,936 vocabulary) and tools/bench/context_parallel.py (a rank's at CP2)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_measures_both_heads_and_the_chunked_one_holds_less(tmp_path):
    out = tmp_path / "lc.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/long_context.py"), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    [row] = result["memory"]
    assert row["tokens"] == 512 and not row["whole_extrapolated"], row
    # the whole head holds ~5 float32 copies of 512 x 151,936 (0.29 GiB each); the chunked one (128 tokens a
    # chunk) a quarter of that (measured at 1024 tokens and chunks of 256: 2.9 GiB and 0.77 GiB, ratio 0.265)
    assert row["whole_bytes"] > 4 * 512 * VOCAB_BYTES and row["ratio"] < 0.4, row
    assert set(result["speed"]) == {"0", "128"} and all(
        s["tokens_per_s"] > 0 for s in result["speed"].values()
    )
    assert "ratio" in proc.stdout and "tokens/s" in proc.stdout


VOCAB_BYTES = 151_936 * 4


def test_context_parallel_smoke_measures_a_rank_at_cp2(tmp_path):
    out = tmp_path / "cp.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/bench/context_parallel.py"),
            "--smoke",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    # each rank holds half of the 512-token row, and its pass holds at least one chunk's logits (128 tokens)
    assert row["tokens"] == 512 and 256 <= row["cp2"]["local_tokens"] <= 264, row
    assert row["cp2"]["peak_bytes"] > 128 * VOCAB_BYTES, row
    assert "512 tokens: cp2" in proc.stdout

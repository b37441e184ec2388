"""The dashboard page as a user sees it: real headless Chromium against a live ActorManager.

Chromium runs the page's JavaScript (``--virtual-time-budget`` lets its 2 s polling run) and dumps
the rendered DOM; the test reads the numbers back from their element ids. It also saves a
screenshot (path printed; run with -s) for a human look. Skips when Chromium is not installed
(`make test` installs it when run as root).
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rlmega.workers import coordinator
from rlmega.workers.coordinator import ActorManager

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=5000"]

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="chromium not installed (apt-get install chromium)")


class FrozenClock:
    """The coordinator's clock (asyncio keeps the real one): rates and ETA become exact numbers."""

    def __init__(self):
        self.t = 1000.0

    def monotonic(self):
        return self.t

    def sleep(self, s):
        import time
        time.sleep(s)


def _chromium(tmp_path: Path, *args: str) -> str:
    out = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _text(dom: str, element_id: str) -> str:
    m = re.search(rf'id="{re.escape(element_id)}"[^>]*>([^<]*)<', dom)
    assert m, f"no element id={element_id!r} in the DOM"
    return m.group(1)


@pytest.fixture
def clock(monkeypatch):
    c = FrozenClock()
    monkeypatch.setattr(coordinator, "time", c)
    return c


def test_page_renders_reported_numbers_and_charts(tmp_path, clock):
    manager = ActorManager()
    try:
        rewards = [0.125, 0.25, 0.375, 0.5, 0.625]
        for step, reward in enumerate(rewards, start=1):
            clock.t += 10
            manager.report_token_statistics(prefill_tokens=1000, decode_tokens=3000)
            manager.report_batch_generation_time(step, 4.0)
            manager.report_training_step_time(step, 6.0)
            manager.report_metrics(step, {"reward_mean": reward, "kl_ref": 0.002 * step})
            manager.report_progress(step, 20)
        manager.register_queue("rollouts", lambda: 12)
        manager.set_kv_cache_max_concurrency(0, 137.5)
        url = f"http://127.0.0.1:{manager.get_dashboard_port()}/"

        dom = _chromium(tmp_path, "--dump-dom", url)
        # 5 x 4000 tokens in the 50 s the run has existed; 10 s/step, 15 steps left.
        expected = {"tokens-per-s": "400", "prefill-tokens-per-s": "100", "decode-tokens-per-s": "300",
                    "total-tokens": "20000", "step": "5", "total-steps": "20", "eta": "2m 30s",
                    "s-per-step": "10", "training-step-last": "6", "batch-generation-mean": "4",
                    "training-step-count": "5", "queue-rollouts": "12", "kv-engine-0": "137.5",
                    "metric-reward_mean": "0.625", "metric-kl_ref": "0.01", "should-stop": "false",
                    "run-state": "running"}
        assert {k: _text(dom, k) for k in expected} == expected

        # The reward chart: an inline <svg> whose line has one point per step, rising (SVG y grows down).
        chart = re.search(r'id="chart-reward_mean">(.*?)</div>', dom, re.S).group(1)
        assert "<svg" in chart
        points = re.search(r'<polyline[^>]*points="([^"]+)"', chart).group(1).split()
        ys = [float(p.split(",")[1]) for p in points]
        assert len(ys) == len(rewards) and ys == sorted(ys, reverse=True) and ys[0] > ys[-1]
        assert re.search(r'id="chart-kl_ref">.*?<svg.*?<polyline', dom, re.S)
        assert '">no data yet<' not in dom

        shot = tmp_path / "dashboard.png"
        _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,900", url)
        assert shot.stat().st_size > 10_000  # a real rendering, not a blank page
        print(f"dashboard screenshot: {shot}")
    finally:
        manager.cleanup()


def test_page_without_metrics_says_no_data_yet(tmp_path):
    manager = ActorManager()
    try:
        dom = _chromium(tmp_path, "--dump-dom", f"http://127.0.0.1:{manager.get_dashboard_port()}/")
        for chart in ("chart-reward_mean", "chart-kl_ref"):
            assert re.search(rf'id="{chart}"><div class="empty">no data yet</div>', dom), dom
        assert _text(dom, "run-state") == "running"  # the status arrived; the charts are just empty
    finally:
        manager.cleanup()

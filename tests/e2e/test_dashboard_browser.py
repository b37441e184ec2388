"""The dashboard page as a user sees it: real headless Chromium against a live ActorManager.

Chromium runs the page's JavaScript (``--virtual-time-budget`` lets its 2 s polling run) and dumps
the rendered DOM; the test reads the numbers back from their element ids. It also saves a
screenshot (path printed; run with -s) for a human look. Skips when Chromium is not installed
(`make test` installs it when run as root).
"""

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from rlmega.launch import coordinator
from rlmega.launch.coordinator import ActorManager

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=5000",
]

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="chromium not installed (apt-get install chromium)"
)


class FrozenClock:
    """The coordinator's clock (asyncio keeps the real one): rates and ETA become exact numbers."""

    def __init__(self):
        self.t = 1000.0

    def monotonic(self):
        return self.t

    def sleep(self, s):
        time.sleep(s)


def _chromium(tmp_path: Path, *args: str) -> str:
    out = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
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
        manager.set_startup(
            [
                {"phase": "Ray", "start_s": 3.0, "end_s": 5.5, "seconds": 2.5},
                {"phase": "engines", "start_s": 6.0, "end_s": 12.25, "seconds": 6.25},
            ]
        )
        url = f"http://127.0.0.1:{manager.get_dashboard_port()}/"

        dom = _chromium(tmp_path, "--dump-dom", url)
        # 5 x 4000 tokens in the 50 s the run has existed; 10 s/step, 15 steps left.
        expected = {
            "tokens-per-s": "400",
            "prefill-tokens-per-s": "100",
            "decode-tokens-per-s": "300",
            "total-tokens": "20000",
            "step": "5",
            "total-steps": "20",
            "eta": "2m 30s",
            "s-per-step": "10",
            "training-step-last": "6",
            "batch-generation-mean": "4",
            "training-step-count": "5",
            "queue-rollouts": "12",
            "kv-engine-0": "137.5",
            "startup-Ray": "2.5",
            "startup-engines": "6.25",
            "metric-reward_mean": "0.625",
            "metric-kl_ref": "0.01",
            "should-stop": "false",
            "run-state": "running",
        }
        assert {k: _text(dom, k) for k in expected} == expected

        # The reward chart: an inline <svg> whose line has one point per step, rising (SVG y grows down).
        chart = re.search(r'id="chart-reward_mean">(.*?)</div>', dom, re.S).group(1)
        assert "<svg" in chart
        points = re.search(r'<polyline[^>]*points="([^"]+)"', chart).group(1).split()
        ys = [float(p.split(",")[1]) for p in points]
        assert len(ys) == len(rewards) and ys == sorted(ys, reverse=True) and ys[0] > ys[-1]
        assert re.search(r'id="chart-kl_ref">.*?<svg.*?<polyline', dom, re.S)
        assert not re.search(r'id="chart-(reward_mean|kl_ref)"><div class="empty">', dom)

        shot = tmp_path / "dashboard.png"
        _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,900", url)
        assert shot.stat().st_size > 10_000  # a real rendering, not a blank page
        print(f"dashboard screenshot: {shot}")
    finally:
        manager.cleanup()


def _points(dom: str, line_id: str) -> list[tuple[float, float]]:
    """The (x, y) points of the polyline with this id, the last one for each x: a queue is polled
    several times per (frozen) second, and a poll that read the size just before the test changed
    it may stamp it with the new time; the test moves the clock first, so the right size comes last."""
    tag = re.search(rf'<polyline[^>]*\bid="{re.escape(line_id)}"[^>]*>', dom)
    assert tag, f"no polyline id={line_id!r} in the DOM"
    points = re.search(r'points="([^"]+)"', tag.group(0)).group(1).split()
    pts = [tuple(map(float, p.split(","))) for p in points]
    return list(dict(pts).items())


def _height(dom: str, rect_id: str) -> float:
    tag = re.search(rf'<rect[^>]*id="{re.escape(rect_id)}"[^>]*>', dom)
    assert tag, f"no rect id={rect_id!r} in the DOM"
    return float(re.search(r'height="([^"]+)"', tag.group(0)).group(1))


def test_page_renders_staleness_busy_and_queue_charts(tmp_path, clock):
    manager = ActorManager(poll_interval_s=0.25)  # 120 samples: 30 s before the first rolls off
    try:
        sizes = {"prompts": 8, "results": 0}
        manager.register_queue("prompts", lambda: sizes["prompts"])
        manager.register_queue("results", lambda: sizes["results"])
        # One sample a (frozen-clock) second; wait for the poller to record each one.
        for prompts, results in [(6, 2), (6, 5), (1, 3)]:
            clock.t += 1  # before the sizes change: see _points
            sizes.update(prompts=prompts, results=results)
            deadline = time.monotonic() + 10
            while [manager.status()["queues"][n]["history"][-1][1] for n in sizes] != [
                prompts,
                results,
            ]:
                assert time.monotonic() < deadline, "the poller did not pick up the new sizes"
                time.sleep(0.02)
        manager.report_staleness(1, {0: 30, 1: 2})
        manager.report_staleness(2, {0: 20, 1: 10, 2: 2})
        manager.report_staleness(3, {0: 25, 2: 7, 4: 1})  # nothing at 3: a zero bar, not a gap
        for step, (engine, trainer) in enumerate(
            [(0.5, 0.25), (0.75, 0.5), (0.875, 0.625)], start=1
        ):
            manager.report_busy(step, engine, trainer)

        dom = _chromium(tmp_path, "--dump-dom", f"http://127.0.0.1:{manager.get_dashboard_port()}/")
        cumulative = {0: 75, 1: 12, 2: 9, 3: 0, 4: 1}
        expected = {
            **{f"staleness-{k}": str(n) for k, n in cumulative.items()},
            "staleness-last-0": "25",
            "staleness-last-1": "0",
            "staleness-last-2": "7",
            "staleness-last-4": "1",
            "staleness-last-step": "3",
            "staleness-mean": "0.3505",  # (1 x 12 + 2 x 9 + 4 x 1) / 97 trajectories
            "busy-engine": "87.5%",
            "busy-trainer": "62.5%",
            "queue-prompts": "1",
            "queue-results": "3",
        }
        assert {k: _text(dom, k) for k in expected} == expected
        assert 'id="staleness-5"' not in dom  # bars stop at the largest staleness reported

        # Bars in proportion to the counts.
        heights = {k: _height(dom, f"staleness-bar-{k}") for k in cumulative}
        assert heights[0] > 0 and heights[3] == 0
        for k in (1, 2, 4):
            assert heights[k] / heights[0] == pytest.approx(cumulative[k] / cumulative[0])
        assert re.search(r'id="staleness-chart"><svg', dom)

        # Busy: one line per role, a point per step; the engines stay above the trainer (y grows down).
        engine = sorted(_points(dom, "chart-busy-line-engine"))  # left to right
        trainer = sorted(_points(dom, "chart-busy-line-trainer"))
        assert len(engine) == len(trainer) == 3
        assert all(e[0] == t[0] and e[1] < t[1] for e, t in zip(engine, trainer))
        assert [p[1] for p in engine] == sorted((p[1] for p in engine), reverse=True)  # rising

        # Queues: a chart each, a point per second, higher for a bigger queue.
        for name, history in {"prompts": [8, 6, 6, 1], "results": [0, 2, 5, 3]}.items():
            assert re.search(rf'id="chart-queue-{name}"><svg', dom)
            pts = _points(dom, f"chart-queue-{name}-line")
            assert len(pts) == len(history) and [p[0] for p in pts] == sorted(p[0] for p in pts)
            rank = lambda xs: sorted(range(len(xs)), key=lambda i: xs[i])  # noqa: E731
            assert rank([-p[1] for p in pts]) == rank(history)

        shot = tmp_path / "dashboard-async.png"
        _chromium(
            tmp_path,
            f"--screenshot={shot}",
            "--window-size=1200,1200",
            f"http://127.0.0.1:{manager.get_dashboard_port()}/",
        )
        print(f"dashboard screenshot: {shot}")
    finally:
        manager.cleanup()


def test_page_without_metrics_says_no_data_yet(tmp_path):
    manager = ActorManager()
    try:
        dom = _chromium(tmp_path, "--dump-dom", f"http://127.0.0.1:{manager.get_dashboard_port()}/")
        for chart in ("chart-reward_mean", "chart-kl_ref", "chart-busy"):
            assert re.search(rf'id="{chart}"><div class="empty">no data yet</div>', dom), dom
        # Before a step reports staleness or busy fractions the page says so; the queues charted are the
        # coordinator's own two (both empty).
        assert re.search(r'id="staleness-chart"><div class="empty">none reported', dom), dom
        assert not re.search(r'id="staleness-\d', dom)  # no bars
        assert sorted(set(re.findall(r'id="chart-queue-(\w+)"', dom))) == ["prompts", "results"]
        assert _text(dom, "queue-prompts") == _text(dom, "queue-results") == "0"
        assert [_text(dom, i) for i in ("busy-engine", "busy-trainer", "staleness-mean")] == [
            "–"
        ] * 3
        assert _text(dom, "run-state") == "running"  # the status arrived; the charts are just empty
    finally:
        manager.cleanup()

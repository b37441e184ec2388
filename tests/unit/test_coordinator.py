"""ActorManager in-process, and its dashboard over real HTTP on 127.0.0.1 (the server is under test)."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from rlmega.dashboard.app import prometheus_text
from rlmega.launch import coordinator
from rlmega.launch.coordinator import ActorManager


class FakeClock:
    """Stands in for the coordinator module's ``time``: monotonic() only moves when told."""

    def __init__(self, t=1000.0):
        self.t = t

    def monotonic(self):
        return self.t

    def sleep(self, s):
        time.sleep(s)


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    # this module's clock only; asyncio keeps the real one
    monkeypatch.setattr(coordinator, "time", c)
    return c


@pytest.fixture
def manager():
    m = ActorManager(poll_interval_s=0.05)
    yield m
    m.cleanup()


def _get(m, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{m.get_dashboard_port()}{path}", timeout=5) as r:
        return r.status, r.headers["Content-Type"], r.read().decode()


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_should_stop_flag():
    m = ActorManager(dashboard=False)
    assert m.should_stop() is False
    m.set_should_stop()
    assert m.should_stop() is True
    m.set_should_stop(False)
    assert m.should_stop() is False
    assert m.get_dashboard_port() == -1
    m.cleanup()


def test_token_rate_is_tokens_in_window_over_elapsed_time(clock):
    m = ActorManager(dashboard=False, token_window_s=60.0)
    clock.t += 10
    m.report_token_statistics(prefill_tokens=100, decode_tokens=300)
    s = m.get_token_stats()
    # Younger than the window: the rate is over the 10 s the run has existed.
    assert s["tokens_per_s"] == pytest.approx(40.0)
    assert s["prefill_tokens_per_s"] == pytest.approx(10.0)
    assert s["decode_tokens_per_s"] == pytest.approx(30.0)
    clock.t += 50  # 60 s old: the whole window
    m.report_token_statistics(200, 600)
    assert m.get_token_stats()["tokens_per_s"] == pytest.approx(1200 / 60)
    clock.t += 55  # the first report (at t0+10) is now 105 s old: out of the window
    s = m.get_token_stats()
    assert s["tokens_per_s"] == pytest.approx(800 / 60)
    assert (s["total_prefill_tokens"], s["total_decode_tokens"], s["total_tokens"]) == (
        300,
        900,
        1200,
    )
    clock.t += 61
    assert m.get_token_stats()["tokens_per_s"] == 0.0
    assert m.get_token_stats()["total_tokens"] == 1200  # totals never roll off
    m.cleanup()


def test_token_report_with_seconds_is_spread_over_its_interval(clock):
    m = ActorManager(dashboard=False, token_window_s=10.0)
    clock.t += 100
    # 50 tok/s for the last 20 s; half in the window
    m.report_token_statistics(0, 1000, seconds=20.0)
    assert m.get_token_stats()["decode_tokens_per_s"] == pytest.approx(50.0)
    clock.t += 5  # 5 s of that interval still in the window, over a 10 s window
    assert m.get_token_stats()["decode_tokens_per_s"] == pytest.approx(25.0)
    m.cleanup()


def test_timing_stats_last_mean_count():
    m = ActorManager(dashboard=False)
    assert m.get_timing_stats() == {}
    for step, (train, gen) in enumerate([(2.0, 1.0), (4.0, 3.0), (6.0, 2.0)], start=1):
        m.report_training_step_time(step, train)
        m.report_batch_generation_time(step, gen)
    t = m.get_timing_stats()
    assert t["training_step"] == {"last": 6.0, "mean": 4.0, "count": 3, "step": 3}
    assert t["batch_generation"] == {"last": 2.0, "mean": 2.0, "count": 3, "step": 3}
    m.cleanup()


def test_metrics_history_kv_progress_and_eta(clock):
    m = ActorManager(dashboard=False)
    m.report_metrics(1, {"reward_mean": 0.1, "kl_ref": 0.0})
    m.report_metrics(1, {"loss": float("nan")})  # same step, reported in pieces: one row
    m.report_metrics(2, {"reward_mean": 0.3})
    m.set_kv_cache_max_concurrency(0, 137.5)
    m.set_kv_cache_max_concurrency(1, 12)
    m.set_startup([{"phase": "Ray", "start_s": 3.0, "end_s": 5.5, "seconds": 2.5}])
    m.report_progress(1, 11)
    clock.t += 30
    m.report_progress(4, 11)  # 3 steps in 30 s -> 10 s/step, 7 steps left
    s = m.status()
    assert s["metrics_history"] == [
        {"step": 1, "reward_mean": 0.1, "kl_ref": 0.0, "loss": None},
        {"step": 2, "reward_mean": 0.3},
    ]
    assert s["latest_metrics"] == {"step": 2, "reward_mean": 0.3}
    assert s["kv_cache_max_concurrency"] == {"0": 137.5, "1": 12.0}
    assert s["startup"] == [{"phase": "Ray", "start_s": 3.0, "end_s": 5.5, "seconds": 2.5}]
    assert s["progress"] == {"step": 4, "total_steps": 11, "s_per_step": 10.0, "eta_s": 70.0}
    assert s["uptime_s"] == 30.0 and s["should_stop"] is False
    json.dumps(s, allow_nan=False)  # NaN became None: the status is strict JSON
    m.cleanup()


def test_queue_polling_picks_up_changes():
    m = ActorManager(dashboard=False, poll_interval_s=0.05)
    items = [1, 2, 3]
    m.register_queue("rollouts", lambda: len(items))
    assert m.status()["queues"]["rollouts"]["size"] == 3  # first poll happens on registration
    items.clear()
    _wait_for(lambda: m.status()["queues"]["rollouts"]["size"] == 0)
    m.register_queue("broken", lambda: 1 / 0)
    q = m.status()["queues"]
    assert q["broken"]["size"] is None and "ZeroDivisionError" in q["broken"]["error"]
    items.append(9)  # the broken queue does not stop the others from being polled
    _wait_for(lambda: m.status()["queues"]["rollouts"]["size"] == 1)
    assert [h[1] for h in m.status()["queues"]["rollouts"]["history"]][-1] == 1
    m.cleanup()
    assert not m._poller.is_alive()


def test_staleness_histogram_accumulates_and_last_step_is_replaced():
    m = ActorManager(dashboard=False)
    # a sync run
    assert m.status()["staleness"] == {"cumulative": {}, "last_step": None, "last": {}}
    m.report_staleness(1, {1: 2, 0: 30})
    m.report_staleness(2, {2: 2, 0: 20, 1: 10})
    m.report_staleness(2, {0: 5})  # the same step in pieces: adds up
    st = m.status()["staleness"]
    assert st == {
        "cumulative": {"0": 55, "1": 12, "2": 2},
        "last_step": 2,
        "last": {"0": 25, "1": 10, "2": 2},
    }
    # in staleness order, whatever the report order
    assert list(st["cumulative"]) == ["0", "1", "2"]
    m.report_staleness(3, {0: 40, 11: 1})
    st = m.status()["staleness"]
    assert st["last_step"] == 3 and st["last"] == {"0": 40, "11": 1}  # step 2's counts are gone
    assert st["cumulative"] == {"0": 95, "1": 12, "2": 2, "11": 1}
    assert list(st["cumulative"]) == ["0", "1", "2", "11"]  # numeric order, not "11" before "2"
    json.dumps(m.status(), allow_nan=False)
    m.cleanup()


@pytest.mark.parametrize(
    "args, name",
    [
        ((1, {-1: 3}), "staleness must be an int >= 0"),
        ((1, {0.5: 3}), "staleness must be an int >= 0"),
        ((1, {"1": 3}), "staleness must be an int >= 0"),
        ((1, {0: 4, 1: -2}), "count for staleness 1"),
        ((1, {0: 2.5}), "count for staleness 0"),
        ((1, [(0, 3)]), "counts must be a dict"),
        ((-1, {0: 3}), "step must be an int >= 0"),
    ],
)
def test_report_staleness_rejects_bad_input_and_records_nothing(args, name):
    m = ActorManager(dashboard=False)
    m.report_staleness(0, {0: 1})
    with pytest.raises(ValueError, match=name):
        m.report_staleness(*args)
    assert m.status()["staleness"] == {"cumulative": {"0": 1}, "last_step": 0, "last": {"0": 1}}
    m.cleanup()


def test_busy_latest_and_bounded_history():
    m = ActorManager(dashboard=False)
    assert m.status()["busy"] == {"step": None, "engine": None, "trainer": None, "history": []}
    m.report_busy(1, engine_fraction=0.5, trainer_fraction=0.25)
    m.report_busy(2, 0.75, 1.0)
    m.report_busy(2, 0.875, 0.5)  # the same step again: replaces, does not add a point
    assert m.status()["busy"] == {
        "step": 2,
        "engine": 0.875,
        "trainer": 0.5,
        "history": [[1, 0.5, 0.25], [2, 0.875, 0.5]],
    }
    for step in range(3, coordinator.BUSY_HISTORY_LEN + 11):
        m.report_busy(step, 0.0, 1)
    b = m.status()["busy"]
    assert len(b["history"]) == coordinator.BUSY_HISTORY_LEN
    assert b["history"][0][0] == 11 and b["history"][-1] == [
        coordinator.BUSY_HISTORY_LEN + 10,
        0.0,
        1.0,
    ]
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        m.report_busy(-1, 0.5, 0.5)
    json.dumps(m.status(), allow_nan=False)
    m.cleanup()


@pytest.mark.parametrize("bad", [-0.01, 1.01, float("nan"), float("inf"), "0.5", None, True])
@pytest.mark.parametrize("name", ["engine_fraction", "trainer_fraction"])
def test_report_busy_rejects_a_fraction_outside_0_1(name, bad):
    m = ActorManager(dashboard=False)
    kwargs = {"engine_fraction": 0.5, "trainer_fraction": 0.5, name: bad}
    with pytest.raises(ValueError, match=name):
        m.report_busy(1, **kwargs)
    assert m.status()["busy"]["history"] == []
    m.cleanup()


def test_prometheus_staleness_and_busy():
    m = ActorManager(dashboard=False)
    quiet = prometheus_text(m.status(json_safe=False))
    assert "rlmega_staleness" not in quiet and "rlmega_busy" not in quiet  # nothing reported yet
    m.report_staleness(1, {0: 30, 2: 2})
    m.report_staleness(2, {0: 20, 1: 10})
    m.report_busy(2, 0.875, 0.5)
    lines = prometheus_text(m.status(json_safe=False)).splitlines()
    assert [line for line in lines if "rlmega_staleness" in line] == [
        "# HELP rlmega_staleness_trajectories Trajectories trained since the start, by staleness "
        "(trainer step - sampling weight version).",
        "# TYPE rlmega_staleness_trajectories gauge",
        'rlmega_staleness_trajectories{staleness="0"} 50',
        'rlmega_staleness_trajectories{staleness="1"} 10',
        'rlmega_staleness_trajectories{staleness="2"} 2',
    ]
    assert [line for line in lines if line.startswith("rlmega_busy")] == [
        'rlmega_busy_fraction{role="engine"} 0.875',
        'rlmega_busy_fraction{role="trainer"} 0.5',
    ]
    assert "# TYPE rlmega_busy_fraction gauge" in lines
    m.cleanup()


def test_api_status_and_metrics_over_http(manager):
    port = manager.get_dashboard_port()
    assert port > 0
    manager.report_token_statistics(1000, 3000, seconds=2.0)
    manager.report_training_step_time(7, 2.5)
    manager.report_batch_generation_time(7, 1.25)
    manager.set_kv_cache_max_concurrency(3, 42.0)
    manager.register_queue("rollouts", lambda: 17)
    manager.report_metrics(7, {"reward_mean": 0.625, "kl_ref": 0.002, "pg/clip frac": 0.1})
    manager.report_progress(7, 100)
    manager.set_should_stop()

    code, ctype, body = _get(manager, "/api/status")
    assert code == 200 and ctype.startswith("application/json")
    s = json.loads(body)
    assert s["tokens"]["total_tokens"] == 4000
    assert s["timings"]["training_step"]["last"] == 2.5
    assert s["timings"]["batch_generation"]["mean"] == 1.25
    assert s["kv_cache_max_concurrency"] == {"3": 42.0}
    assert s["queues"]["rollouts"]["size"] == 17
    assert s["latest_metrics"]["reward_mean"] == 0.625
    assert s["progress"]["step"] == 7 and s["progress"]["total_steps"] == 100
    assert s["should_stop"] is True

    code, ctype, text = _get(manager, "/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
    lines = set(text.splitlines())
    for expected in [
        'rlmega_should_stop 1',
        'rlmega_tokens_total{kind="prefill"} 1000',
        'rlmega_tokens_total{kind="decode"} 3000',
        'rlmega_training_step_seconds 2.5',
        'rlmega_batch_generation_seconds 1.25',
        'rlmega_queue_size{queue="rollouts"} 17',
        'rlmega_kv_cache_max_concurrency{engine="3"} 42',
        'rlmega_metric{name="reward_mean"} 0.625',
        'rlmega_metric{name="pg_clip_frac"} 0.1',
        'rlmega_step 7',
        'rlmega_total_steps 100',
        '# TYPE rlmega_tokens_per_second gauge',
    ]:
        assert expected in lines, f"{expected!r} missing from\n{text}"
    rate = next(line for line in lines if line.startswith('rlmega_tokens_per_second{kind="total"}'))
    assert float(rate.split()[-1]) > 0

    code, ctype, html = _get(manager, "/")
    assert code == 200 and ctype.startswith("text/html")
    assert 'id="tokens-per-s"' in html and "api/status" in html
    assert "<script src" not in html and "https://" not in html  # self-contained: no CDN


@pytest.mark.parametrize("path", ["/", "/api/status", "/metrics"])
def test_only_get_is_allowed(manager, path):
    req = urllib.request.Request(
        f"http://127.0.0.1:{manager.get_dashboard_port()}{path}", data=b"{}", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 405


def test_cleanup_stops_server_and_is_idempotent():
    m = ActorManager(poll_interval_s=0.05)
    port = m.get_dashboard_port()
    assert _get(m, "/api/status")[0] == 200
    m.cleanup()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    m.cleanup()  # second call: no error, nothing to do
    assert m.get_dashboard_port() == -1
    assert not m._poller.is_alive()
    m.report_metrics(1, {"reward_mean": 1.0})  # the stats stay usable after cleanup
    assert m.status()["latest_metrics"]["reward_mean"] == 1.0


def test_a_taken_port_raises_at_construction(manager):
    pollers = lambda: sum(t.name == "rlmega-queue-poll" for t in threading.enumerate())  # noqa: E731
    before = pollers()
    with pytest.raises(OSError):
        ActorManager(port=manager.get_dashboard_port())
    assert pollers() == before  # the failed manager cleaned up after itself

"""The dashboard's read-only HTTP app: ``make_app(manager)``; ``ActorManager`` serves it with uvicorn.

    GET /            the page (rlmega/dashboard/page.py): polls /api/status every 2 s
    GET /api/status  manager.status() as JSON
    GET /metrics     Prometheus text format 0.0.4, for scraping into Grafana

Only GET routes exist, so anything else answers 405: nothing here can change the run.
"""

from __future__ import annotations

import math
import re

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from rlmega.dashboard.page import PAGE_HTML

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def make_app(manager) -> FastAPI:
    # No /docs or /openapi.json: the Swagger page loads from a CDN the machines cannot reach.
    app = FastAPI(title="rlmega dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        return HTMLResponse(PAGE_HTML)

    @app.get("/api/status")
    def api_status() -> JSONResponse:
        return JSONResponse(manager.status(), headers={"Cache-Control": "no-store"})

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        text = prometheus_text(manager.status(json_safe=False))
        return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)

    return app


def prometheus_text(s: dict) -> str:
    """Render a ``status()`` dict as Prometheus gauges (and counters for token totals)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[dict, float | None]]) -> None:
        samples = [(labels, v) for labels, v in samples if v is not None]
        if not samples:
            return
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        for labels, v in samples:
            lab = ",".join(f'{k}="{_escape(str(x))}"' for k, x in labels.items())
            lines.append(f"{name}{{{lab}}} {_num(v)}" if lab else f"{name} {_num(v)}")

    tok, tim, prog = s["tokens"], s["timings"], s["progress"]
    family(
        "rlmega_should_stop",
        "gauge",
        "1 once the stop flag is set.",
        [({}, float(s["should_stop"]))],
    )
    family(
        "rlmega_uptime_seconds",
        "gauge",
        "Seconds since the coordinator started.",
        [({}, s["uptime_s"])],
    )
    family(
        "rlmega_tokens_per_second",
        "gauge",
        f"Token throughput over the last {tok['window_s']:g} s.",
        [({"kind": k}, tok[f"{k}_tokens_per_s"]) for k in ("prefill", "decode")]
        + [({"kind": "total"}, tok["tokens_per_s"])],
    )
    family(
        "rlmega_tokens_total",
        "counter",
        "Tokens processed since the start.",
        [({"kind": k}, tok[f"total_{k}_tokens"]) for k in ("prefill", "decode")],
    )
    for kind in ("training_step", "batch_generation"):
        t = tim.get(kind, {})
        family(
            f"rlmega_{kind}_seconds",
            "gauge",
            f"Duration of the last {kind.replace('_', ' ')}.",
            [({}, t.get("last"))],
        )
        family(
            f"rlmega_{kind}_seconds_mean",
            "gauge",
            f"Mean {kind.replace('_', ' ')} duration.",
            [({}, t.get("mean"))],
        )
    family("rlmega_step", "gauge", "Steps completed.", [({}, prog["step"])])
    family("rlmega_total_steps", "gauge", "Steps planned.", [({}, prog["total_steps"])])
    family(
        "rlmega_eta_seconds", "gauge", "Estimated seconds to the last step.", [({}, prog["eta_s"])]
    )
    family(
        "rlmega_queue_size",
        "gauge",
        "Items waiting in each registered queue.",
        [({"queue": n}, q["size"]) for n, q in s["queues"].items()],
    )
    # Cumulative, yet a gauge: the name is the one dashboards query, and a counter would want "_total".
    family(
        "rlmega_staleness_trajectories",
        "gauge",
        "Trajectories trained since the start, by staleness (trainer step - sampling weight version).",
        [({"staleness": k}, n) for k, n in s["staleness"]["cumulative"].items()],
    )
    family(
        "rlmega_busy_fraction",
        "gauge",
        "Fraction of the last step's wall time each role was busy.",
        [({"role": r}, s["busy"][r]) for r in ("engine", "trainer")],
    )
    family(
        "rlmega_kv_cache_max_concurrency",
        "gauge",
        "vLLM KV-cache max concurrency per engine.",
        [({"engine": e}, v) for e, v in s["kv_cache_max_concurrency"].items()],
    )
    # Metric names become label values in the Prometheus name charset ("reward/mean" -> "reward_mean").
    latest = {_sanitise(k): v for k, v in s["latest_metrics"].items() if k != "step"}
    family(
        "rlmega_metric",
        "gauge",
        "Latest value of each training metric.",
        [({"name": k}, v) for k, v in sorted(latest.items())],
    )
    return "\n".join(lines) + "\n"


def _sanitise(name: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_:]", "_", name)
    return name if re.match(r"[a-zA-Z_:]", name) else "_" + name


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)

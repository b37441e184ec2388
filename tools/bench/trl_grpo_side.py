"""TRL's side of tools/bench/grpo_vs_trl.py: K GRPO steps of TRL's GRPOTrainer, timed per step.

Runs in TRL's own environment (torch + trl, no rlmega installed), started by grpo_vs_trl.py:

    TRL_PY tools/bench/trl_grpo_side.py --model DIR --prompts PROMPTS.json --out OUT.json [--steps K]

PROMPTS.json is ``[[{"prompt": "12+34=", "label": "46"}, ...8 rows], ...]``, one list per step: the
prompts rlmega draws for the same steps, so both sides see the same problems in the same order
(``shuffle_dataset=False``; TRL's RepeatSampler then takes 8 rows per step, each 8 times). The reward
is rlmega/rewards/arithmetic.py's ``score``, loaded by file path (it is pure Python).

OUT.json: {"config": {...}, "steps": [{"step", "time_step", "time_generate", "time_reward",
"time_logprob", "time_train", "response_length", "reward_mean"}, ...]}. time_step is wall time from
``on_step_begin`` to ``on_step_end`` (a TrainerCallback): the generation, the reward, the reference
forward, forward+backward and the optimizer step. The phases are this file's clocks around
GRPOTrainer's own methods: generate = ``_generate`` (tokenize, ``model.generate``, decode), reward =
``_calculate_rewards``, logprob = the rest of ``_generate_and_score_completions`` (the frozen reference's
forward, advantages), train = time_step - all of those (forward, backward, clip, AdamW).

No smoke mode of its own: it needs TRL, which CI does not install. CI runs ``grpo_vs_trl.py --smoke``
(rlmega's side alone, tests/e2e/test_grpo_vs_trl_bench.py); with TRL's venv (``make bench-trl-env``)
``grpo_vs_trl.py --smoke --trl-python runs/bench/trl-venv/bin/python`` runs this file on the tiny model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from collections import defaultdict


def load_score(path: str):
    """rlmega's reward function, by file path: TRL's env has no rlmega package (nor its deps)."""
    spec = importlib.util.spec_from_file_location("rlmega_arithmetic_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.score


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument(
        "--prompts", required=True, help="JSON: one list of {prompt, label} rows per step"
    )
    p.add_argument("--reward-file", required=True, help="rlmega/rewards/arithmetic.py")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=None, help="default: one per list in --prompts")
    p.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads (the machine's cores)"
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=64,
        help="per_device_train_batch_size; gradient accumulation makes up the 64 samples of a step",
    )
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0, help="TRL's seed: here, only the sampling's")
    p.add_argument(
        "--generation",
        choices=["generate", "continuous_batching"],
        default="generate",
        help="model.generate (padded batch, KV cache) or transformers' continuous batching",
    )
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    score = load_score(args.reward_file)
    per_step = json.load(open(args.prompts))
    steps = args.steps or len(per_step)
    rows = [r for batch in per_step[:steps] for r in batch]
    prompts_per_step = len(per_step[0])
    samples = prompts_per_step * args.num_generations
    if samples % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide {samples} samples per step")

    def arithmetic_reward(completions, label, **_):
        return [score(c, lab) for c, lab in zip(completions, label)]

    phases: dict[str, float] = defaultdict(float)

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with clocks around the phases (nothing else changes)."""

        def _timed(self, name, fn, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[name] += time.perf_counter() - t0

        def _generate(self, *a, **kw):
            return self._timed("generate", super()._generate, *a, **kw)

        def _calculate_rewards(self, *a, **kw):
            return self._timed("reward", super()._calculate_rewards, *a, **kw)

        def _generate_and_score_completions(self, *a, **kw):
            return self._timed(
                "generate_and_score", super()._generate_and_score_completions, *a, **kw
            )

    out: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            phases.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            step_s = time.perf_counter() - self.t0
            rest = phases["generate_and_score"] - phases["generate"] - phases["reward"]
            out.append(
                {
                    "step": state.global_step,
                    "time_step": step_s,
                    "time_generate": phases["generate"],
                    "time_reward": phases["reward"],
                    "time_logprob": rest,
                    "time_train": step_s - phases["generate_and_score"],
                }
            )

        # after on_step_end (logging_steps=1)
        def on_log(self, args_, state, control, logs=None, **kw):
            # not the closing train_runtime log
            if out and logs and "completions/mean_length" in logs:
                out[-1].update(
                    response_length=logs["completions/mean_length"], reward_mean=logs.get("reward")
                )
                print(json.dumps(out[-1]), flush=True)

    with tempfile.TemporaryDirectory(prefix="trl-grpo-bench-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            seed=args.seed,
            # The defaults are bf16 autocast (~10x slower on this CPU) and gradient checkpointing
            # (recomputes every forward): both off, float32 like rlmega.
            bf16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=samples // args.micro_batch,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=args.beta,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            max_steps=steps,
            shuffle_dataset=False,
            use_transformers_continuous_batching=args.generation == "continuous_batching",
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,  # the dataset is 8 strings a step: a worker process only adds start-up
        )
        trainer = TimedGRPOTrainer(
            model=args.model,
            reward_funcs=arithmetic_reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            callbacks=[StepTimer()],
        )
        trainer.train()
    import trl
    import transformers

    result = {
        "config": {
            **vars(args),
            "steps": steps,
            "torch": torch.__version__,
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "optim": config.optim,
            "loss_type": config.loss_type,
        },
        "steps": out,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

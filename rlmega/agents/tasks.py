"""Tasks: several (prompts, agent loop with its judgers, weight) mixed in every step's batch.

    tasks = Tasks(task_configs(cfg), tokenizer, prompts_per_step=cfg.trainer.prompts_per_step,
                  model_path=cfg.model.path, rollout=cfg.rollout)   # task_configs: rlmega.config.resolved
    picked = tasks.next_prompts()                 # [(task name, Prompt)], prompts_per_step of them
    tasks.state_dict() / load_state_dict(...)     # every task's sampler position, for exact resume

Each step takes ``counts[k]`` prompts from task k: trainer.prompts_per_step split by weight with the
largest-remainder rule (fixed per run, so a batch always holds the same mix and resume is exact);
validation refuses a task whose share rounds to 0 prompts.
"""

from __future__ import annotations

from rlmega.config.schema import RolloutConfig, TaskConfig
from rlmega.config.task_rules import split_by_weight
from rlmega.data.images import load_processor
from rlmega.data.prompts import PromptData, load_prompt_data


class Tasks:
    def __init__(
        self,
        tasks: list[TaskConfig],
        tokenizer,
        *,
        prompts_per_step: int,
        model_path: str,
        rollout: RolloutConfig,
    ):
        """``tasks``: rlmega.config.resolved.task_configs(cfg); ``prompts_per_step``: trainer's; ``model_path``:
        model.path (a vision-language model's processor); ``rollout``: its prompt-length and image limits."""
        self.configs = list(tasks)
        self.counts = split_by_weight(prompts_per_step, [t.weight for t in self.configs])
        # a vision-language model's processor: image prompts' tokens, and the images' pixels for the trainer
        self.processor = load_processor(model_path)
        self.data: dict[str, PromptData] = {
            t.name: load_prompt_data(
                t.data,
                tokenizer,
                rollout.max_prompt_tokens,
                k,
                self.processor,
                rollout.max_images_per_prompt,
            )
            for t, k in zip(self.configs, self.counts)
        }

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.configs]

    def next_prompts(self) -> list[tuple[str, object]]:
        return [(name, p) for name, d in self.data.items() for p in d.next_prompts()]

    def warmup_prompts(self, i: int) -> list[tuple[str, object]]:
        return [(name, p) for name, d in self.data.items() for p in d.warmup_prompts(i)]

    def eval_prompts(self) -> dict[str, list]:
        return {name: d.eval_prompts for name, d in self.data.items() if d.eval_prompts}

    def config(self, name: str) -> TaskConfig:
        return next(t for t in self.configs if t.name == name)

    def state_dict(self) -> dict:
        # the layout checkpoints had before tasks
        if len(self.data) == 1 and "default" in self.data:
            return self.data["default"].state_dict()
        return {"tasks": {name: d.state_dict() for name, d in self.data.items()}}

    def load_state_dict(self, state: dict) -> None:
        if "tasks" not in state:
            self.data[self.names[0]].load_state_dict(state)
            return
        missing = set(self.data) - set(state["tasks"])
        if missing:
            raise ValueError(
                f"the checkpoint has no data position for task(s) {sorted(missing)}; "
                "resume with the tasks the run was started with"
            )
        for name, d in self.data.items():
            d.load_state_dict(state["tasks"][name])

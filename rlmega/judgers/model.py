"""ModelJudger: a judge model on its own vLLM engine (a RolloutWorker hosted as a Ray actor).

    judger = ModelJudger("judge", "/models/judge", prompt_template="{prompt}{response}\\ncorrect? ",
                         max_tokens=4, engine_kwargs={"device": "cpu", "max_model_len": 512})

From a config, the judger's own fields give the engine (``engine_settings``: device, max_model_len and
gpu_memory_utilization or kv_cache_space_gb; rlmega.judgers.factory).

For each trajectory the judge is asked `prompt_template.format(prompt=..., response=..., label=...)`
(a literal brace in the template is written `{{`), tokenized with the judge model's own tokenizer
(transformers AutoTokenizer), and answers greedily (temperature 0, n=1, at most max_tokens tokens), so
the same item always gets the same verdict. Items that arrive within `batch_wait_s` of each other go to
the engine as one `generate` call (vLLM batches them), at most `max_batch` at a time.

The reward is read from the decoded answer by `rlmega.judgers.verdict.parse_verdict`: a leading
number in [0, 1] is the reward (one outside it gives 0); otherwise a first word "yes" or "y" gives 1;
anything else 0. So "0.75 because" -> 0.75, "Yes." -> 1.0, "12" -> 0.0, "no" -> 0.0.

The engine starts when the judger is built; `ready()` (which `judge` awaits before an item's clock
starts) waits up to `startup_timeout_s` for it. A prompt too long for the engine (prompt tokens +
max_tokens > max_model_len) is that item's error. An engine that dies is not restarted (a start costs
minutes): every later item fails fast with the reason, flagged, and the run goes on.
"""

from __future__ import annotations

import asyncio
import os

import ray

from rlmega.config.judger_rules import check_template
from rlmega.judgers.base import JudgeError, Judger, JudgeItem, RawVerdict
from rlmega.judgers.ray_actors import first_line
from rlmega.judgers.verdict import parse_verdict

_MiB = 1 << 20
DEFAULT_MAX_MODEL_LEN = 512  # RolloutWorker's default


DEFAULT_JUDGE_CONTEXT = 4096  # max_model_len null: the judge model's context, at most this


def engine_settings(c) -> dict:
    """RolloutWorker keyword arguments for judger ``c``'s engine (a JudgerConfig of kind model): its own
    device and context (device, max_model_len) and the memory setting of that device, so a judge never
    silently gets RolloutWorker's defaults (a CPU engine of 512 tokens). device null (a config not
    resolved by load_config, which sets rollout.device): cpu. max_model_len null: the judge model's
    max_position_embeddings, at most 4096 (a longer context needs a KV cache of its size to start)."""
    from rlmega.config.judger_rules import max_positions

    device = c.device or "cpu"
    length = c.max_model_len
    if length is None:
        length = min(max_positions(c.model_path) or DEFAULT_JUDGE_CONTEXT, DEFAULT_JUDGE_CONTEXT)
    out = {"device": device, "max_model_len": int(length)}
    if device == "cuda":
        out["gpu_memory_utilization"] = float(c.gpu_memory_utilization)
    else:
        out["kv_cache_space_gb"] = float(c.kv_cache_space_gb)
    return out


class ModelJudger(Judger):
    kind = "model"

    def __init__(
        self,
        name: str,
        model_path: str,
        *,
        prompt_template: str = "{response}={label}?",
        max_tokens: int = 4,
        timeout_s: float = 60.0,
        weight: float = 1.0,
        cpus_per_actor: float = 0.25,
        memory_mb_per_actor: int = 0,
        num_gpus: float = 0.0,
        placement_group=None,
        bundle_index: int = -1,
        engine_kwargs: dict | None = None,
        max_batch: int = 64,
        batch_wait_s: float = 0.005,
        startup_timeout_s: float = 600.0,
    ):
        super().__init__(name, timeout_s=timeout_s, weight=weight)
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ValueError(f"judger {name!r}: model_path={model_path!r} has no config.json")
        check_template(prompt_template)
        if max_tokens < 1:
            raise ValueError(f"judger {name!r}: max_tokens={max_tokens} must be >= 1")
        if not ray.is_initialized():
            raise RuntimeError(
                f"judger {name!r} (model) needs a running Ray: call ray.init() first"
            )
        from transformers import AutoTokenizer

        from rlmega.rollout.rollout import RolloutWorker

        self.model_path, self.prompt_template, self.max_tokens = (
            model_path,
            prompt_template,
            max_tokens,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        engine_kwargs = dict(engine_kwargs or {})
        self.max_model_len = engine_kwargs.setdefault("max_model_len", DEFAULT_MAX_MODEL_LEN)
        self.max_batch, self.batch_wait_s, self.startup_timeout_s = (
            max_batch,
            batch_wait_s,
            startup_timeout_s,
        )
        options: dict = {"num_cpus": cpus_per_actor, "num_gpus": num_gpus}
        if memory_mb_per_actor > 0:
            options["memory"] = int(memory_mb_per_actor) * _MiB
        if placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle_index
            )
        self.engine = (
            ray.remote(RolloutWorker).options(**options).remote(model_path, **engine_kwargs)
        )
        self._started = self.engine.weight_version.remote()  # answers once the engine is up
        self._is_ready = False
        self._queue: list[tuple[list[int], asyncio.Future]] = []
        self._flush_timer: asyncio.TimerHandle | None = None
        # running batches (a task must be referenced to live)
        self._batches: set[asyncio.Task] = set()

    async def ready(self) -> None:
        if not self._is_ready:
            try:
                await asyncio.wait_for(self._started, self.startup_timeout_s)
            except TimeoutError:
                raise JudgeError(
                    f"its engine did not start within {self.startup_timeout_s:g}s"
                ) from None
            except Exception as e:
                raise JudgeError(f"its engine failed to start: {first_line(e)}") from None
            self._is_ready = True

    def judge_prompt(self, item: JudgeItem) -> str:
        return self.prompt_template.format(
            prompt=item.prompt_text, response=item.response_text, label=item.label
        )

    async def verdict_text(self, item: JudgeItem) -> str:
        """What the judge model says about `item` (decoded, special tokens dropped)."""
        ids = self.tokenizer.encode(self.judge_prompt(item))
        if len(ids) + self.max_tokens > self.max_model_len:
            raise JudgeError(
                f"the judge prompt has {len(ids)} tokens; with max_tokens={self.max_tokens} that "
                f"exceeds the engine's max_model_len={self.max_model_len}"
            )
        return self.tokenizer.decode(await self._generate(ids), skip_special_tokens=True)

    async def _judge(self, item: JudgeItem) -> RawVerdict:
        return parse_verdict(await self.verdict_text(item))

    # ---- batching: items arriving together share one generate call ----------------------------
    async def _generate(self, prompt_ids: list[int]) -> list[int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((prompt_ids, future))
        if len(self._queue) >= self.max_batch:
            self._flush()
        elif self._flush_timer is None:
            self._flush_timer = loop.call_later(self.batch_wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        batch, self._queue = self._queue, []
        task = asyncio.get_running_loop().create_task(self._run_batch(batch))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _run_batch(self, batch: list[tuple[list[int], asyncio.Future]]) -> None:
        # items that timed out meanwhile are dropped
        batch = [(ids, f) for ids, f in batch if not f.done()]
        if not batch:
            return
        try:
            samples = await self.engine.generate.remote(
                prompts=[ids for ids, _ in batch], n=1, temperature=0.0, max_tokens=self.max_tokens
            )
        except Exception as e:
            error = JudgeError(f"judge engine failed: {first_line(e)}")
            for _, f in batch:
                if not f.done():
                    f.set_exception(error)
            return
        for sample in samples:
            f = batch[sample.prompt_index][1]
            if not f.done():
                f.set_result(sample.response_ids)

    def close(self) -> None:
        try:
            ray.get(self.engine.shutdown.remote(), timeout=30)
        except Exception:  # dead already, or shutdown hung: kill it either way
            pass
        try:
            ray.kill(self.engine)
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"ModelJudger(name={self.name!r}, model_path={self.model_path!r}, max_tokens={self.max_tokens})"

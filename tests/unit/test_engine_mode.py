"""How many CUDA graphs a compiled engine captures: the run's own largest batch per engine, on vLLM's grid."""

from rlmega.config.engine_mode import capture_grid_size, cuda_graph_max_batch, engine_batch_bound
from rlmega.config.schema import AgentLoopConfig, RLConfig, TaskConfig


def _cfg(**rollout) -> RLConfig:
    cfg = RLConfig()
    # compiled: CUDA graphs
    cfg.rollout.device, cfg.trainer.prompts_per_step, cfg.rollout.n = "cuda", 8, 8
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def test_capture_grid_size_lands_on_vllms_grid():
    """vLLM truncates a maximum off its grid to the size below it, where a batch of exactly n runs eagerly."""
    assert [
        capture_grid_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65, 248, 249, 256, 257, 511, 10_000)
    ] == [1, 2, 4, 4, 8, 8, 16, 64, 72, 248, 256, 256, 272, 512, 512]


def test_the_bound_counts_production_eval_engines_and_routers():
    cfg = _cfg()
    # eval off: 8 x 8, one router (the driver's)
    assert engine_batch_bound(cfg, eval_requests=100) == 64 + 1
    cfg.trainer.eval_every = 5  # under async an eval may run beside production: both count
    assert engine_batch_bound(cfg, eval_requests=100) == 164 + 1
    cfg.rollout.num_engines = 3
    assert engine_batch_bound(cfg, eval_requests=100) == 55 + 1  # ceil(164 / 3)
    cfg.tasks = [
        TaskConfig(name="a", agent_loop=AgentLoopConfig(num_ray_actors=4)),
        TaskConfig(name="b"),
    ]
    # each loop process routes by its own counts
    assert engine_batch_bound(cfg, eval_requests=100) == 55 + 5


def test_cuda_graph_max_batch_resolves_the_field():
    cfg = _cfg()
    assert cuda_graph_max_batch(cfg, eval_requests=0) == 72  # 65 sequences: the grid size above
    # the eval set unknown: vLLM's default
    assert cuda_graph_max_batch(cfg, eval_requests=None) is None
    cfg.rollout.cuda_graph_max_batch = 24  # set: used as given
    assert cuda_graph_max_batch(cfg, eval_requests=None) == 24
    cfg.rollout.enforce_eager = True  # an eager engine captures nothing
    assert cuda_graph_max_batch(cfg, eval_requests=0) is None
    cpu = _cfg(device="cpu")  # eager by default on CPU
    assert cuda_graph_max_batch(cpu, eval_requests=0) is None

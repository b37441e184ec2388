"""Every file in configs/ runs from a fresh clone with the command its first line gives (issue 27 item 4).

The first line is `# COMMAND`, where COMMAND is `rlmega ...` or `python tools/...`, several joined by `&&`.
Each part is parsed by the real command's own parser here, and must name this config. Then the model the
command would make is made (into a temporary folder, in this process) and `rlmega check-config`'s checks
(rlmega.cli.check_config: schema, preflight on this machine, the prompts tokenized) pass on the config.
Configs whose model and data live on a GPU cluster's storage (absolute paths) cannot pass here: for them the
only problems allowed are those missing folders and files, and the GPU this machine does not have.
"""

import importlib.util
import shlex
from pathlib import Path

import pytest
import yaml

from rlmega import cli, train, train_args
from rlmega.config import ConfigError
from rlmega.demo.tiny_model import make_tiny_model
from rlmega.demo.tiny_vlm import VLM_ARCHITECTURES, make_tiny_vlm

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
IDS = [p.name for p in CONFIGS]
# What a cluster config may lack on this machine: its storage's model and prompt files, and a GPU.
CLUSTER_ONLY = ("model.path:", "data.train_path:", "data.eval_path:", "rollout.device:")


def _tool_parser(script: str):
    """The argparse parser of a tools/ script (its parser() function), loaded from the checkout."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parser()


def _parse(name: str, argv: list):
    """Parse one command with its own parser: (its kind, the parsed arguments); a test failure naming the
    config when the command would not even start."""
    try:
        if argv[:2] == ["rlmega", "train"]:
            return "train", train_args.parse(argv[2:])
        if argv[:1] == ["rlmega"]:
            return argv[1], cli.parser().parse_args(argv[1:])
        if argv[:1] == ["python"] and len(argv) > 1 and argv[1].startswith("tools/"):
            assert (ROOT / argv[1]).is_file(), (
                f"configs/{name}: first line runs {argv[1]}, which is not in the checkout"
            )
            return argv[1], _tool_parser(argv[1]).parse_args(argv[2:])
    except SystemExit:
        pytest.fail(
            f"configs/{name}: the first line's command {shlex.join(argv)!r} does not parse (see stderr)"
        )
    pytest.fail(
        f"configs/{name}: the first line's command {shlex.join(argv)!r} is neither `rlmega ...` nor "
        "`python tools/...`"
    )


def first_line_commands(path: Path) -> list:
    """[(kind, parsed arguments)] of the config's first line, `# CMD [&& CMD ...]`."""
    line = path.read_text().splitlines()[0]
    assert line.startswith("# "), (
        f"configs/{path.name}: the first line must be `# COMMAND` (how to run it), not {line!r}"
    )
    return [_parse(path.name, shlex.split(part)) for part in line[2:].split("&&")]


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_the_first_line_is_the_command_that_runs_this_config(path):
    commands = first_line_commands(path)
    kind, args = commands[-1]  # the last part runs the config; any before it make what it needs
    assert kind in ("train", "demo"), (
        f"configs/{path.name}: the first line's last command must be rlmega train or demo"
    )
    # `rlmega demo` alone runs the demo's config
    named = args.config or str(ROOT / "configs" / "demo_cpu.yaml")
    assert (ROOT / named).resolve() == path, (
        f"configs/{path.name}: the first line runs {named}, not this file"
    )
    model = (yaml.safe_load(path.read_text()).get("model") or {}).get("path", "")
    run_dir = (yaml.safe_load(path.read_text()).get("trainer") or {}).get("run_dir", "")
    for kind, made in commands[:-1]:  # what the first parts make is where the config looks
        assert kind == "tools/make_tiny_model.py", (
            f"configs/{path.name}: unexpected first part {kind}"
        )
        assert made.out_dir == model, (
            f"configs/{path.name}: the first line makes {made.out_dir}, model.path is {model}"
        )
        assert made.if_missing, (
            f"configs/{path.name}: give --if-missing, so running the line again keeps the model"
        )
    # the demo makes RUN_DIR/tiny_model: the config's model.path should be that folder
    if kind == "demo":
        assert model == f"{args.run_dir or run_dir}/tiny_model", (
            f"configs/{path.name}: model.path is {model}, but `rlmega demo` makes the model in "
            f"{args.run_dir or run_dir}/tiny_model: set model.path to that, so `rlmega train` finds it afterwards"
        )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Models the first lines make, each made once, in a temporary folder: {what makes it: folder}."""
    made = {}

    def get(key, **shape):
        if key not in made:
            out = tmp_path_factory.mktemp("model") / "m"
            # what tools/make_tiny_model.py passes on to make_tiny_vlm
            if shape.get("arch") in VLM_ARCHITECTURES:
                made[key] = make_tiny_vlm(
                    out,
                    **{
                        k: shape[k]
                        for k in ("arch", "hidden_size", "num_layers", "num_heads", "seed")
                    },
                )
            else:
                made[key] = make_tiny_model(out, **shape)
        return made[key]

    return get


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_check_config_passes_on_the_model_the_first_line_makes(path, models, tmp_path):
    commands = first_line_commands(path)
    model = None
    for kind, args in commands:
        if kind == "demo":
            model = models("demo", **cli.DEMO_MODEL)
        elif kind == "tools/make_tiny_model.py":
            shape = {
                k: v
                for k, v in vars(args).items()
                if k not in ("out_dir", "if_missing", "overwrite")
            }
            model = models(tuple(sorted(shape.items())), **shape)
    overrides = [f"trainer.run_dir={tmp_path / 'run'}"] + ([f"model.path={model}"] if model else [])
    try:
        cli.check_config(path, overrides)
    except ConfigError as e:
        if (
            model is not None
            or not Path((yaml.safe_load(path.read_text())["model"])["path"]).is_absolute()
        ):
            pytest.fail(
                f"configs/{path.name}: rlmega check-config fails on the model its first line makes:\n{e}"
            )
        other = [p for p in e.problems if not p.startswith(CLUSTER_ONLY)]
        assert not other, (
            f"configs/{path.name} (a cluster config): problems beyond its storage and GPUs:\n"
            + "\n".join(other)
        )
    except cli.PromptDataError as e:
        pytest.fail(f"configs/{path.name}: {e}")
    else:
        assert (
            model is not None
            or not Path(yaml.safe_load(path.read_text())["model"]["path"]).is_absolute()
        )


def test_demo_takes_the_configs_run_dir_and_length(tmp_path, monkeypatch):
    """`rlmega demo --config X` (the first line of several configs) runs X in X's trainer.run_dir, for X's
    trainer.total_steps, on the demo's model made in RUN_DIR/tiny_model; overrides still win."""
    seen = []
    monkeypatch.setattr(train, "main", lambda argv: seen.append(argv) or 0)
    run = tmp_path / "calc"
    (run / "tiny_model").mkdir(parents=True)
    (run / "tiny_model" / "config.json").write_text("{}")  # made once: not again
    config = ROOT / "configs" / "agent_calculator_cpu.yaml"
    assert cli.main(["demo", "--config", str(config), f"trainer.run_dir={run}"]) == 0
    assert seen[-1] == [
        str(config),
        f"model.path={run / 'tiny_model'}",
        f"trainer.run_dir={run}",
        f"trainer.run_dir={run}",
    ]  # no trainer.total_steps: the config's own 30
    # no override: the config's runs/agent_calculator, relative to where it runs
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "agent_calculator" / "tiny_model").mkdir(parents=True)
    (tmp_path / "runs" / "agent_calculator" / "tiny_model" / "config.json").write_text("{}")
    assert cli.main(["demo", "--config", str(config), "--steps", "3"]) == 0
    assert seen[-1][1:4] == [
        "model.path=runs/agent_calculator/tiny_model",
        "trainer.run_dir=runs/agent_calculator",
        "trainer.total_steps=3",
    ]

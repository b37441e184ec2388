"""The actor interface: the driver side imports no backend, and every backend implements all of it."""

import inspect
import pickle
import subprocess
import sys

import pytest

from rlmega.learner.actor_api import BACKENDS, Actor, BackendFactory, actor_class


def test_the_driver_imports_no_backend():
    # The Ray driver process runs train.py and Roles; only the ranks may load megatron-core or FSDP.
    code = (
        "import sys, rlmega.cli, rlmega.train, rlmega.launch.roles, rlmega.step, rlmega.agents.produce\n"
        "print(sorted(m for m in sys.modules if m.startswith(('rlmega.megatron', 'rlmega.fsdp', 'megatron'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_each_backend_implements_the_whole_interface(backend):
    cls = actor_class(backend)
    assert issubclass(cls, Actor)
    assert not inspect.isabstract(cls), (
        f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unimplemented"
    )
    # the constructor every launcher calls (actor_api.Actor's docstring)
    params = list(inspect.signature(cls).parameters)
    assert params[:5] == ["model", "parallel", "optimizer", "actor", "algorithm"], params
    for name in ("temperature", "lr_decay_steps", "hf_config", "num_threads"):
        assert name in params, (cls.__name__, name)


def test_learner_pickles_and_refuses_an_unknown_backend():
    assert pickle.loads(pickle.dumps(BackendFactory("fsdp"))) == BackendFactory("fsdp")
    with pytest.raises(
        ValueError,
        match=r"actor.backend='deepspeed' is not a backend; choose one of \['fsdp', 'megatron'\]",
    ):
        BackendFactory("deepspeed")


def _imports(path):
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_each_backend_library_is_imported_only_in_its_package():
    # DESIGN: only rlmega/megatron/ imports megatron.core, only rlmega/fsdp/ imports FSDP (and DCP's
    # state-dict helpers that drive it); reading a checkpoint's metadata (checkpoint_scan) is neither.
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "rlmega"
    owners = {
        "megatron": "megatron",
        "torch.distributed.fsdp": "fsdp",
        "torch.distributed.checkpoint.state_dict": "fsdp",
        "torch.distributed._composable": "fsdp",
    }
    wrong = []
    for path in sorted(root.rglob("*.py")):
        package = path.relative_to(root).parts[0]
        for name in _imports(path):
            for prefix, owner in owners.items():
                if (name == prefix or name.startswith(prefix + ".")) and package != owner:
                    wrong.append(
                        f"{path.relative_to(root.parent)} imports {name} (only rlmega/{owner}/ may)"
                    )
    assert not wrong, "\n".join(wrong)


def test_megatron_actor_built_in_code_refuses_activation_checkpointing():
    # config validation refuses it for backend megatron; an actor built without a config file must too
    from rlmega.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
    )

    with pytest.raises(
        ValueError, match="actor.activation_checkpointing=true: the megatron backend"
    ):
        actor_class("megatron")(
            ModelConfig(),
            ParallelismConfig(),
            OptimizerConfig(),
            ActorConfig(activation_checkpointing=True),
            AlgorithmConfig(),
        )


def test_workers_are_called_through_their_interface():
    """Issue 58: the driver names a rank's method by the interface's own function, never a string: a misspelt one
    fails where it is written (and in `make lint`'s type check, mypy.ini, with the arguments); a method of the
    other interface, or a string, is refused before anything is sent."""
    import re
    from pathlib import Path

    from rlmega.launch.roles import method_name
    from rlmega.learner.critic_api import Critic

    assert method_name(Actor.train_step, Actor) == "train_step"
    assert method_name(Critic.compute_values, Critic) == "compute_values"
    for method, interface in (
        (Critic.train_step, Actor),
        (Actor.compute_logprobs, Critic),
        ("train_step", Actor),
    ):
        with pytest.raises(TypeError, match="is not a method of"):
            method_name(method, interface)
    root = Path(__file__).resolve().parents[2] / "rlmega"
    by_string = [
        f"{p.relative_to(root)}:{n}"
        for p in root.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\b(call_policy|call_critic|submit_critic)\(\s*[\"']", line)
        or p.name == "roles.py"
        and re.search(r"_ranks\.(call|submit)\w*\(\s*[\"']", line)
    ]
    assert by_string == []

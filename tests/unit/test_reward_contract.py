"""The reward contract as users of TRL and verl expect it (issue 56).

A reward function in a file of one's own (`reward.fn: path/to/file.py:function`): it resolves from any directory
once the config has made its path absolute, the same path gives the same function, and each way it can be wrong
names the file and the fix; a dotted path that is really a file here says to write it as a file. What the
function gets: the response without special tokens (the raw text by name), the prompt and the row's other
columns by name; and when it raises, the error names its file and line.
"""

import asyncio
import os

import pytest

from pathlib import Path

from rlmega.config.dotted_path import RewardResolveError, absolute, resolve, shape_problem
from rlmega.config.errors import ConfigError
from rlmega.config.load import load_config
from rlmega.judgers.base import JudgeItem
from rlmega.judgers.native import NativeJudger

ROOT = Path(__file__).resolve().parents[2]

REWARD = '''
import math

def exact(response_text, label, **kwargs):
    return float(response_text.strip() == str(label))

class Scores:
    @staticmethod
    def half(response_text, label, **kwargs):
        return 0.5
'''


def test_a_file_reward_resolves_from_anywhere_once_the_config_made_it_absolute(
    tmp_path, monkeypatch
):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "my_reward.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["reward.fn=mine/my_reward.py:exact"])
    assert cfg.reward.fn == f"{tmp_path}/mine/my_reward.py:exact"  # what Ray's workers are handed
    monkeypatch.chdir("/")  # a worker runs elsewhere
    fn = resolve(cfg.reward.fn)
    assert fn("46 ", "46") == 1.0 and fn("47", "46") == 0.0
    assert resolve(cfg.reward.fn) is fn  # one module per file and process
    assert resolve(f"{tmp_path}/mine/my_reward.py:Scores.half")("x", None) == 0.5
    assert absolute("rlmega.rewards.arithmetic.score") == "rlmega.rewards.arithmetic.score"


@pytest.mark.parametrize(
    "spec, what, fix",
    [
        (
            "missing.py:exact",
            "no file missing.py (from {cwd}: {cwd}/missing.py)",
            "give the path of the Python file",
        ),
        (
            "my_reward.py:exakt",
            "'my_reward.py' has no attribute 'exakt'",
            "did you mean my_reward.py:exact?",
        ),
        (
            "broken.py:exact",
            "running {cwd}/broken.py failed: ZeroDivisionError",
            "fix the error in {cwd}/broken.py",
        ),
        (
            "needs.py:exact",
            "No module named 'not_a_package_here'",
            "install the missing package 'not_a_package_here'",
        ),
        (
            "my_reward.py:math",
            "'my_reward.py:math' is a module, not a callable",
            "fn(response_text, label",
        ),
        (
            "my_reward.py:",
            "is not path/to/file.py:function",
            "path/to/file.py:function for a file of your own",
        ),
    ],
)
def test_each_wrong_file_reward_names_the_file_and_the_fix(tmp_path, monkeypatch, spec, what, fix):
    (tmp_path / "my_reward.py").write_text(REWARD)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    (tmp_path / "needs.py").write_text("import not_a_package_here\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardResolveError) as e:
        resolve(spec)
    assert what.format(cwd=tmp_path) in e.value.what, e.value
    assert fix.format(cwd=tmp_path) in e.value.fix, e.value


def test_a_dotted_path_that_is_a_file_here_says_to_name_the_file(tmp_path, monkeypatch):
    """The user's trap: `reward.fn=my_reward.exact` run from the file's own folder is "not found" (the console
    script's sys.path does not hold the current directory); the fix must say what to write instead."""
    (tmp_path / "my_reward.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardResolveError) as e:
        resolve("my_reward.exact")
    assert "module 'my_reward' not found" in e.value.what
    assert (
        e.value.fix
        == f"{tmp_path}/my_reward.py is a file, not an installed module: name it as a file, "
        "my_reward.py:exact (path/to/file.py:function)"
    )
    os.remove(tmp_path / "my_reward.py")
    with pytest.raises(RewardResolveError) as e:
        resolve("my_reward.exact")
    assert e.value.fix.startswith(
        "for a file of your own, write path/to/file.py:function; for a package"
    )


def test_the_config_checks_the_shape_of_either_form():
    assert shape_problem("pkg.mod.fn") is None and shape_problem("a/b.py:fn") is None
    assert shape_problem("a/b.py:C.fn") is None
    assert shape_problem("a/b.txt:fn") == "is not a dotted path"
    assert shape_problem("a/b.py:1fn") == "is not path/to/file.py:function"
    with pytest.raises(ConfigError, match="reward.fn: 'nodots' is not a dotted path"):
        load_config(None, ["reward.fn=nodots"])


def test_a_reward_gets_the_prompt_the_raw_text_and_the_rows_columns_by_name(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def by_name(response_text, label, prompt, response_raw, difficulty, columns, **kwargs):\n"
        "    return {'reward': float(response_text == label), 'difficulty': difficulty,\n"
        "            'raw': float(response_raw.endswith('</s>')), 'prompt': len(prompt), 'n': len(columns),\n"
        "            'kw': len(kwargs)}\n"
        "def plain(completion, answer, **kwargs):\n"
        "    return float(completion == answer) + len(kwargs)\n"
        "def fails(response_text, label, **kwargs):\n"
        "    table = {}\n"
        "    return table[label]\n"
    )
    item = JudgeItem(
        prompt_text="12+34=",
        response_text="46",
        response_raw="46</s>",
        label="46",
        columns={"difficulty": 3, "source": "gsm8k", "answer": "shadowed"},
    )
    got = asyncio.run(NativeJudger("r", f"{tmp_path}/mine.py:by_name").judge(item))
    assert got.error is None, got.error
    assert got.scores == {
        "r": 1.0,
        "r/difficulty": 3.0,
        "r/raw": 1.0,
        "r/prompt": 6.0,
        "r/n": 3.0,
        "r/kw": 0.0,
    }
    # a column reaches only a parameter named for it: none lands in **kwargs, and the label's place is the label's
    assert asyncio.run(NativeJudger("r", f"{tmp_path}/mine.py:plain").judge(item)).reward == 1.0
    failed = asyncio.run(NativeJudger("r", f"{tmp_path}/mine.py:fails").judge(item))
    assert failed.error == f"judger 'r' (native): KeyError: '46' (raised at {tmp_path}/mine.py:9)"
    not_a_number = asyncio.run(NativeJudger("r", "rlmega.testing.judgers.no_reward").judge(item))
    assert "raised at" not in not_a_number.error  # the judger's own check: its message says it all


def test_rows_keep_their_other_columns_for_the_reward(tmp_path):
    from rlmega.data.prompts import PromptDataset, load_rows
    from rlmega.demo.tiny_model import make_tokenizer

    path = tmp_path / "rows.jsonl"
    path.write_text(
        '{"question": "1+1=", "answer": "2", "difficulty": 1, "tags": ["easy"]}\n'
        '{"question": "9+9=", "answer": "18"}\n'
    )
    rows, _ = load_rows(str(path), "question", "answer")
    prompts = list(PromptDataset(rows, make_tokenizer(), max_prompt_tokens=64))
    assert [p.columns for p in prompts] == [{"difficulty": 1, "tags": ["easy"]}, {}]


def test_check_config_calls_the_reward_on_row_1_and_ends_with_a_summary(
    tmp_path, monkeypatch, capsys
):
    from rlmega.cli import main as cli_main
    from rlmega.demo.tiny_model import make_tiny_model

    model = make_tiny_model(
        tmp_path / "m", hidden_size=128, num_heads=2, num_kv_heads=2, num_layers=1, seed=0
    )
    (tmp_path / "rows.jsonl").write_text(
        '{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": "4"}\n'
    )
    (tmp_path / "r.py").write_text(
        "def bad(response_text, label, **kwargs):\n    return float(label['value'])\n\n"
        "def good(response_text, label, **kwargs):\n"
        "    return float(response_text == label)\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = [
        "check-config",
        str(ROOT / "configs/tiny_cpu.yaml"),
        f"model.path={model}",
        "data.train_path=rows.jsonl",
        "parallelism.tensor_model_parallel_size=1",
        "parallelism.pipeline_model_parallel_size=1",
        "parallelism.world_size=1",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    assert cli_main([*argv, "reward.fn=r.py:bad"]) == 2
    err = capsys.readouterr().err
    assert (
        f"reward.fn: {tmp_path}/r.py:bad failed on row 1 of rows.jsonl, given its label '2' as the response: "
        f"TypeError: string indices must be integers, not 'str' (raised at {tmp_path}/r.py:2). Fix: correct the "
        "function"
    ) in err, err
    assert cli_main([*argv, "reward.fn=r.py:good"]) == 0
    from transformers import AutoModelForCausalLM

    size = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters()) / 1e6
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        f"rlmega check-config: OK. qwen2, {size:.1f}M parameters; megatron TP1 x PP1, world 1; 2 prompts "
        "kept, 0 dropped (longer than rollout.max_prompt_tokens)"
    ), last


def test_the_guides_example_reward_scores_its_example_rows():
    """examples/your_own (docs/your_own.md, configs/your_own_cpu.yaml): the rows load, and both rewards of the
    example file score them through a judger as a run does, the column by name included."""
    from rlmega.data.prompts import load_rows

    rows, _ = load_rows(str(ROOT / "examples/your_own/train.jsonl"))
    assert len(rows) == 8 and all(r["columns"]["region"] for r in rows)
    for fn, right, wrong in (
        ("exact_match", 1.0, 0.0),
        ("exact_match_europe_counts_double", 2.0, 0.0),
    ):
        judger = NativeJudger("reward", f"{ROOT}/examples/your_own/my_reward.py:{fn}")
        item = JudgeItem(
            prompt_text="", response_text=" Paris\n", label="Paris", columns=rows[0]["columns"]
        )
        assert asyncio.run(judger.judge(item)).reward == right
        item.response_text = "Lyon"
        assert asyncio.run(judger.judge(item)).reward == wrong

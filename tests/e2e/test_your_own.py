"""docs/your_own.md, followed by a user (issue 56): a model folder transformers made (not one rlmega makes),
chat rows with a column of their own and a reward in a file outside the repository, in a folder of the
user's, through `rlmega check-config` and `rlmega train` on configs/your_own_cpu.yaml with the fields the page
says to replace. One run, three checks, each failing on its own:
- the reward file, named by a path relative to the user's folder, runs in the engine's agent loop (a dotted
  path there was "not found");
- its exact match scores right answers: the warm-started model answers "yes</s>", and only the decoded
  response without special tokens equals the label (with the raw text, every reward is 0);
- the row's own column reaches the reward by name (score/reward/column_seen is 1 only if it did).
"""

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, env, read_metrics

CONFIG = ROOT / "configs" / "your_own_cpu.yaml"
RLMEGA = str(Path(sys.executable).parent / "rlmega")  # the console script, as the user runs it
REWARD = '''
def exact(response_text, label, kind, **kwargs):
    """The user's reward: exact match on the response; "kind" is a column of their rows."""
    return {"reward": float(response_text.strip() == label), "column_seen": float(kind == "fact")}
'''


def _users_model(folder: Path) -> Path:
    """A Llama as a user's training script would save one: transformers' own classes, random weights, and
    a tokenizer with a chat template (rlmega's character-level one: no hub downloads here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlmega.demo.tiny_model import make_tokenizer

    tok = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def test_a_users_own_model_rows_and_reward_file_train_by_the_guide(tmp_path):
    home = tmp_path / "me"  # the user's folder: model, rows and reward, nothing of the repository's
    home.mkdir()
    model = _users_model(home / "my_llama")
    rows = [
        ("Is fire hot?", "yes"),
        ("Is snow white?", "yes"),
        ("Is grass green?", "yes"),
        ("Is the sky blue?", "yes"),
    ]
    (home / "rows.jsonl").write_text(
        "".join(
            f'{{"prompt": [{{"role": "user", "content": "{q}"}}], "label": "{a}", "kind": "fact"}}\n'
            for q, a in rows
        )
    )
    (home / "my_reward.py").write_text(REWARD)
    fields = [f"model.path={model}", "data.train_path=rows.jsonl", "reward.fn=my_reward.py:exact"]
    short = [
        "trainer.total_steps=3",
        "trainer.warmup_sft_steps=30",
        "trainer.warmup_sft_lr=3e-3",
        "rollout.max_response_tokens=8",
        "trainer.save_every=0",
        f"trainer.run_dir={home / 'run'}",
    ]
    check = subprocess.run(
        [RLMEGA, "check-config", str(CONFIG), *fields, *short],
        cwd=home,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.splitlines()[-1].startswith("rlmega check-config: OK. llama, "), (
        check.stdout[-500:]
    )
    out = subprocess.run(
        [RLMEGA, "train", str(CONFIG), *fields, "--resume", *short],
        cwd=home,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    metrics = read_metrics(home / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["reward_errors"] == 0 for m in metrics), [m["reward_errors"] for m in metrics]
    assert all(m["score/reward/column_seen"] == 1.0 for m in metrics), metrics[0]
    print("reward_mean per step:", [m["reward_mean"] for m in metrics])
    assert max(m["reward_mean"] for m in metrics) > 0, [m["reward_mean"] for m in metrics]
    assert (home / "run" / "hf_final" / "config.json").exists()
    assert "Task was destroyed" not in out.stderr  # a clean exit says nothing more (issue 56)

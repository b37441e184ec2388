"""Prompt loading (JSONL, Parquet), tokenization and filtering, and the resumable sampler."""

import json

import pytest

from rlmega.config import DataConfig, RLConfig
from rlmega.data.prompts import (
    SYNTHETIC_EVAL_SIZE,
    BadRowError,
    Prompt,
    PromptDataset,
    PromptSampler,
    load_prompt_data,
    load_prompt_dataset,
    load_rows,
    synthetic_arithmetic_rows,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlmega.demo.tiny_model import make_tiny_model

    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", hidden_size=128, num_heads=2, num_layers=1
    )
    return AutoTokenizer.from_pretrained(str(path))


def write_jsonl(path, lines):
    """`lines`: dicts are dumped as JSON, strings are written verbatim (for malformed rows)."""
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return str(path)


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


CHAT = [{"role": "system", "content": "add."}, {"role": "user", "content": "1+2="}]


# --- loading ----------------------------------------------------------------------------------


def _plain(rows):
    return [{k: v for k, v in r.items() if k != "where"} for r in rows]


def test_jsonl_rows_in_file_order_blank_lines_ignored(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "1+2=", "label": "3", "extra": 1}, "", "   ", {"prompt": CHAT, "label": 3}],
    )
    rows, skipped = load_rows(path, "prompt", "label", "error")
    # where: for later messages
    assert rows == [
        {"prompt": "1+2=", "label": "3", "columns": {"extra": 1}, "where": f"{path}, row 1"},
        {"prompt": CHAT, "label": 3, "where": f"{path}, row 2 (line 4)"},
    ]
    assert skipped.count == 0 and skipped.reasons == []


def test_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "1+2=", "answer": "3"}])
    rows, _ = load_rows(path, prompt_key="question", label_key="answer")
    assert _plain(rows) == [{"prompt": "1+2=", "label": "3"}]


def test_parquet_strings_and_messages(tmp_path):
    path = write_parquet(
        tmp_path / "p.parquet",
        [{"q": "1+2=", "a": "3", "other": 0.5}, {"q": "4+4=", "a": "8", "other": 1.5}],
    )
    rows, skipped = load_rows(path, "q", "a")
    # every column is read: the other ones go to the reward function by name (issue 56)
    assert _plain(rows) == [
        {"prompt": "1+2=", "label": "3", "columns": {"other": 0.5}},
        {"prompt": "4+4=", "label": "8", "columns": {"other": 1.5}},
    ]
    assert rows[1]["where"] == f"{path}, row 2" and skipped.count == 0
    chat = write_parquet(tmp_path / "chat.parquet", [{"prompt": CHAT, "label": "3"}])
    # list<struct> -> list of dicts
    assert _plain(load_rows(chat)[0]) == [{"prompt": CHAT, "label": "3"}]


def test_parquet_bad_rows_name_row(tmp_path):
    path = write_parquet(
        tmp_path / "p.parquet",
        [{"prompt": "1+2=", "label": "3"}, {"prompt": "1+1=", "label": None}],
    )
    with pytest.raises(BadRowError, match=r"p\.parquet, row 2: label 'label' is null.*Fix:"):
        load_rows(path)  # it used to say "missing label key" for a column that is there
    rows, skipped = load_rows(path, on_bad_row="skip")
    assert len(rows) == 1 and skipped.count == 1


def test_parquet_missing_column_is_a_file_error_even_when_skipping(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"text": "1+2=", "label": "3"}])
    with pytest.raises(
        BadRowError, match=r"no prompt column 'prompt' \(columns: \['text', 'label'\]\).*prompt_key"
    ):
        load_rows(path, on_bad_row="skip")


# One line per kind of malformed row: (line as written, words the problem must contain).
BAD_ROWS = [
    ('{"prompt": "1+2=", "label": ', "invalid JSON"),
    ('["1+2=", "3"]', "expected a JSON object"),
    ('{"text": "1+2=", "label": "3"}', "missing prompt key 'prompt'"),
    ('{"prompt": 12, "label": "3"}', "has type int"),
    ('{"prompt": "", "label": "3"}', "is empty"),
    ('{"prompt": [], "label": "3"}', "empty message list"),
    ('{"prompt": ["hi"], "label": "3"}', "message 0"),
    ('{"prompt": [{"role": "user"}], "label": "3"}', "message 0"),
    ('{"prompt": [{"role": "user", "content": 5}], "label": "3"}', "message 0"),
    ('{"prompt": "1+2="}', "missing label key 'label'"),
    ('{"prompt": "1+2=", "label": null}', "label 'label' is null"),
    ('{"prompt": null, "label": "3"}', "prompt 'prompt' is null"),
    ('{"prompt": [{"role": "usr", "content": "1+2="}], "label": "3"}', "has role 'usr'"),
]


@pytest.mark.parametrize("line,problem", BAD_ROWS, ids=[p for _, p in BAD_ROWS])
def test_bad_row_error_names_file_row_problem_fix(tmp_path, line, problem):
    good = '{"prompt": "1+1=", "label": "2"}'
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, line])
    with pytest.raises(BadRowError) as e:
        load_rows(path, on_bad_row="error")
    msg = str(e.value)
    assert msg.startswith(f"{path}, row 3: ") and problem in msg and "Fix:" in msg, msg
    assert isinstance(e.value, ValueError)


def test_row_numbers_skip_blank_lines_and_name_the_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "1+1=", "label": "2"}', "", "{oops"])
    with pytest.raises(BadRowError, match=r"bad\.jsonl, row 2 \(line 3\): invalid JSON"):
        load_rows(path)


def test_skip_mode_counts_and_keeps_first_reasons(tmp_path):
    good = '{"prompt": "1+1=", "label": "2"}'
    lines = [good] + [line for line, _ in BAD_ROWS] + [good]
    rows, skipped = load_rows(write_jsonl(tmp_path / "bad.jsonl", lines), on_bad_row="skip")
    assert len(rows) == 2
    assert skipped.count == len(BAD_ROWS)
    assert len(skipped.reasons) == 5  # only the first few reasons are kept
    assert skipped.reasons[0].startswith(f"{tmp_path / 'bad.jsonl'}, row 2: invalid JSON")
    assert [r.split(": ")[0].rsplit(", ", 1)[1] for r in skipped.reasons] == [
        f"row {i}" for i in range(2, 7)
    ]
    assert "prompt 'prompt' has type int" in skipped.reasons[3]


def test_all_rows_bad_or_empty_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="all 2 rows were bad"):
        load_rows(write_jsonl(tmp_path / "bad.jsonl", ["{", "}"]), on_bad_row="skip")
    with pytest.raises(ValueError, match="empty file"):
        load_rows(write_jsonl(tmp_path / "empty.jsonl", [""]))


def test_file_level_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "p.csv").write_text("prompt,label\n")
    with pytest.raises(ValueError, match="unknown prompt file type '.csv'"):
        load_rows(str(tmp_path / "p.csv"))
    (tmp_path / "arr.json").write_text('[{"prompt": "1+1=", "label": "2"}]\n')
    with pytest.raises(BadRowError, match="JSON array, not JSON Lines"):
        load_rows(str(tmp_path / "arr.json"))
    with pytest.raises(ValueError, match="on_bad_row"):
        load_rows(str(tmp_path / "arr.json"), on_bad_row="ignore")


def test_synthetic_rows_match_make_problems():
    from rlmega.data.arithmetic import make_problems

    rows = synthetic_arithmetic_rows(5, digits=3, seed=7)
    assert rows == [{"prompt": p, "label": a} for p, a in make_problems(5, digits=3, seed=7)]
    assert rows[0]["prompt"].endswith("=") and rows[0]["label"].isdigit()


# --- tokenization ---------------------------------------------------------------------------


def test_plain_prompts_encoded_without_special_tokens(tokenizer):
    rows = synthetic_arithmetic_rows(4, seed=1)
    ds = PromptDataset(rows, tokenizer, max_prompt_tokens=64, apply_chat_template=False)
    assert len(ds) == 4 and ds.num_filtered == 0
    p = ds[2]
    assert (
        isinstance(p, Prompt)
        and p.index == 2
        and p.text == rows[2]["prompt"]
        and p.label == rows[2]["label"]
    )
    assert p.token_ids == tokenizer.encode(rows[2]["prompt"], add_special_tokens=False)
    assert len(p.token_ids) == len(p.text)  # character-level tokenizer, no BOS
    assert [q.index for q in ds] == [0, 1, 2, 3]


def test_chat_messages_and_wrapped_strings_use_the_template(tokenizer):
    rows = [{"prompt": CHAT, "label": "3"}, {"prompt": "1+2=", "label": "3"}]
    ds = PromptDataset(rows, tokenizer, max_prompt_tokens=64, apply_chat_template=True)
    chat, wrapped = ds[0], ds[1]
    assert chat.text == "system: add.\nuser: 1+2=\nassistant: "
    assert chat.token_ids == tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(chat.token_ids) == chat.text
    assert wrapped.text == "user: 1+2=\nassistant: "
    assert wrapped.token_ids == tokenizer.encode(wrapped.text, add_special_tokens=False)
    # Message lists use the template even when apply_chat_template is False.
    assert (
        PromptDataset(rows, tokenizer, 64, apply_chat_template=False)[0].token_ids == chat.token_ids
    )


def test_long_prompts_filtered_and_counted(tokenizer):
    rows = [
        {"prompt": "1+2=", "label": "3"},
        {"prompt": "1" * 9, "label": "x"},
        {"prompt": "12345678", "label": "y"},
        {"prompt": "1" * 30, "label": "z"},
    ]
    ds = PromptDataset(rows, tokenizer, max_prompt_tokens=8)
    assert ds.num_filtered == 2
    assert [p.index for p in ds] == [0, 2]  # index = position in rows; exactly 8 tokens is kept
    assert [p.label for p in ds] == ["3", "y"]


def test_nothing_left_is_a_clear_error(tokenizer):
    rows = [{"prompt": "1" * 10, "label": "x"}, {"prompt": "1" * 12, "label": "y"}]
    with pytest.raises(
        ValueError,
        match=r"none of the 2 prompts fits max_prompt_tokens=4 \(token lengths 10..12\)"
        r".*at least 10",
    ):
        PromptDataset(rows, tokenizer, max_prompt_tokens=4)


def test_load_prompt_dataset_from_config(tokenizer, tmp_path):
    cfg = DataConfig(synthetic_size=6, synthetic_digits=1, seed=3)
    ds = load_prompt_dataset(cfg, tokenizer, max_prompt_tokens=64)
    assert [p.text for p in ds] == [r["prompt"] for r in synthetic_arithmetic_rows(6, 1, 3)]
    held_out = load_prompt_dataset(
        DataConfig(synthetic_size=200, seed=3), tokenizer, 64, split="eval"
    )
    train = {r["prompt"] for r in synthetic_arithmetic_rows(200, 2, 3)}
    assert len(held_out) == SYNTHETIC_EVAL_SIZE and not train & {p.text for p in held_out}
    path = write_jsonl(tmp_path / "e.jsonl", [{"q": "1+1=", "a": "2"}, "{"])
    cfg = DataConfig(eval_path=path, prompt_key="q", label_key="a", on_bad_row="skip")
    assert [p.label for p in load_prompt_dataset(cfg, tokenizer, 64, split="eval")] == ["2"]
    assert load_prompt_dataset(DataConfig(train_path=path), tokenizer, 64, split="eval") is None


def test_prompt_data_resume_and_warmup(tokenizer):
    cfg = DataConfig(synthetic_size=10, seed=2)
    straight = load_prompt_data(cfg, tokenizer, 64, prompts_per_step=4)
    expected = [[p.index for p in straight.next_prompts()] for _ in range(5)]
    assert len(straight.eval_prompts) == SYNTHETIC_EVAL_SIZE

    first = load_prompt_data(cfg, tokenizer, 64, prompts_per_step=4)
    warm = [p.index for p in first.warmup_prompts(3)]
    assert warm == [p.index for p in first.warmup_prompts(3)] and len(warm) == 4  # pure in i
    # warm-up did not move the sampler
    head = [[p.index for p in first.next_prompts()] for _ in range(2)]
    resumed = load_prompt_data(cfg, tokenizer, 64, prompts_per_step=4)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [[p.index for p in resumed.next_prompts()] for _ in range(3)] == expected


def test_data_config_section_and_checks(tmp_path):
    from rlmega.config import ConfigError, load_config, validate

    assert RLConfig().data == DataConfig()
    cfg = load_config(None, ["data.synthetic_size=10", "data.on_bad_row=skip"])
    assert cfg.data.synthetic_size == 10 and cfg.data.on_bad_row == "skip"
    with pytest.raises(ConfigError, match=r"data.synthetic_size: 0 must be in \[1, 1000000\]"):
        load_config(None, ["data.synthetic_size=0"])
    with pytest.raises(ConfigError, match="data.on_bad_row"):
        load_config(None, ["data.on_bad_row=ignore"])
    bad = RLConfig()
    bad.data.train_path = str(tmp_path / "missing.jsonl")
    with pytest.raises(
        ConfigError, match="data.train_path: prompt file .*missing.jsonl' does not exist"
    ):
        validate(bad)


# --- sampler --------------------------------------------------------------------------------


def draw(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_epochs_are_permutations_and_batches_stay_full(shuffle):
    s = PromptSampler(dataset_len=10, batch_size=4, shuffle=shuffle, seed=5)
    flat = sum(draw(s, 5), [])  # 20 indices = exactly two epochs
    assert all(len(b) == 4 for b in draw(PromptSampler(10, 4, shuffle, 5), 5))
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert (flat[:10] != flat[10:]) == shuffle  # a new order each epoch only when shuffling
    assert s.epoch == 2 and s.position == 0


def test_sampler_is_deterministic_and_seeded():
    assert draw(PromptSampler(50, 8, True, 1), 10) == draw(PromptSampler(50, 8, True, 1), 10)
    assert draw(PromptSampler(50, 8, True, 1), 10) != draw(PromptSampler(50, 8, True, 2), 10)


# Resume points: mid-epoch with the next batch crossing the boundary (10, 3); several epochs per
# batch (5, 7); exactly on an epoch boundary (12, 4).
@pytest.mark.parametrize("dataset_len,batch_size", [(10, 3), (5, 7), (12, 4)])
def test_sampler_resume_equals_uninterrupted(dataset_len, batch_size):
    straight = draw(PromptSampler(dataset_len, batch_size, True, 11), 7)

    first = PromptSampler(dataset_len, batch_size, True, 11)
    head = draw(first, 3)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = PromptSampler(dataset_len, batch_size, True, 11)
    resumed.load_state_dict(state)
    tail = draw(resumed, 4)

    assert head + tail == straight
    assert resumed.epoch > state["epoch"]  # the resumed part crossed at least one epoch boundary


def test_sampler_state_checks():
    s = PromptSampler(10, 3, True, 0)
    state = s.state_dict()
    with pytest.raises(ValueError, match="dataset_len=10.*dataset_len=9"):
        PromptSampler(9, 3, True, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0.*seed=1"):
        PromptSampler(10, 3, True, 1).load_state_dict(state)
    # a new batch size continues the same order
    PromptSampler(10, 5, True, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        s.load_state_dict({**state, "position": 10})
    with pytest.raises(ValueError):
        PromptSampler(0, 3)


def test_utf8_bom_on_the_first_line_is_accepted(tmp_path):
    # "UTF-8 with BOM" (common editors) used to reject row 1 with an invalid-JSON hint (issue 10).
    path = tmp_path / "bom.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf" + b'{"prompt": "1+2=", "label": "3"}\n{"prompt": "2+2=", "label": "4"}\n'
    )
    rows, skipped = load_rows(str(path))
    assert [r["label"] for r in rows] == ["3", "4"] and skipped.count == 0


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text("not parquet at all\n")
    with pytest.raises(BadRowError, match=r"fake\.parquet: not a readable Parquet file.*Fix:"):
        load_rows(str(path))


def test_lossy_and_too_long_prompts_are_named_by_row(tokenizer, tmp_path, caplog):
    # The character-level tiny tokenizer has no "@": encoding drops it silently (issue 10).
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "1+2=", "label": "3"},
            {"prompt": "1@2=", "label": "3"},
            {"prompt": "1" * 30, "label": "x"},
        ],
    )
    rows, _ = load_rows(path)
    with caplog.at_level("WARNING"):
        ds = PromptDataset(rows, tokenizer, max_prompt_tokens=8, source=path)
    assert len(ds) == 2 and ds.num_filtered == 1 and ds.num_lossy == 1
    text = caplog.text
    assert f"{path}, row 2" in text and "cannot represent" in text  # lossy: warned, named, kept
    assert f"{path}, row 3 (30 tokens)" in text  # too long: warned with its row
    with pytest.raises(
        BadRowError, match=r"row 3 \(30 tokens\): prompt longer than max_prompt_tokens=8"
    ):
        PromptDataset(rows, tokenizer, max_prompt_tokens=8, source=path, strict=True)
    with pytest.raises(
        BadRowError, match=r"row 2: prompt with characters the tokenizer cannot represent"
    ):
        PromptDataset(rows, tokenizer, max_prompt_tokens=64, source=path, strict=True)
    assert PromptDataset(rows[:1], tokenizer, 8, strict=True).num_lossy == 0


def test_the_synthetic_sequence_task(tokenizer):
    from rlmega.data.sequences import LETTERS, answer, cycle

    cfg = DataConfig(synthetic_task="sequence", synthetic_size=200, synthetic_length=40, seed=2)
    train = load_prompt_dataset(cfg, tokenizer, max_prompt_tokens=8)
    evals = load_prompt_dataset(cfg, tokenizer, max_prompt_tokens=8, split="eval")
    assert len(train) == 200 and {p.text for p in train} == {f"{c}:" for c in LETTERS}
    assert len(evals) == 10 == len({p.text for p in evals})
    for p in list(train)[:20] + list(evals):
        assert p.label == answer(p.text[0], 40, 2) and len(p.token_ids) == 2
    assert sorted(cycle(2)) == list(LETTERS) and cycle(2) != cycle(3)

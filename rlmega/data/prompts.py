"""Prompt datasets: rows from JSONL/Parquet (or a synthetic task), tokenized once,
drawn in a seeded, resumable order.

    rows, skipped = load_rows("train.jsonl", "prompt", "label", on_bad_row="error")
    dataset = PromptDataset(rows, tokenizer, max_prompt_tokens=64, apply_chat_template=False)
    sampler = PromptSampler(len(dataset), batch_size=4, shuffle=True, seed=0)
    prompts = [dataset[i] for i in sampler.next_batch()]     # list[Prompt]

or, from a DataConfig, `load_prompt_data(cfg.data, tokenizer, max_prompt_tokens, prompts_per_step)`.

A row is `{"prompt": str | [{"role", "content"}, ...], "label": ...}` after loading, whatever the
file's column names were; a message's content may be a list of text and image parts
(rlmega/data/images.py), whose images are read and checked at load and kept as `row["images"]`.
The sampler's state (epoch, position) goes into checkpoints, so a resumed
run draws exactly the prompts an uninterrupted one would have.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from rlmega.data.arithmetic import make_problems
from rlmega.data.images import DEFAULT_IMAGE_LIMITS, ImageLimits, processor_vision, split_images
from rlmega.data.sequences import make_sequence_problems
from rlmega.data.shapes import shape_rows

logger = logging.getLogger(__name__)

Messages = List[Dict[str, str]]
Row = Dict[str, Any]  # {"prompt": str | Messages, "label": Any}

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
MAX_SKIP_REASONS = 5  # reasons kept in Skipped; the count covers all of them
# Roles chat templates know; anything else is most likely a typo ("usr") that a template would drop
# or render as plain text.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class Skipped:
    """Rows dropped by on_bad_row="skip": how many, and the first few reasons (file, row, problem)."""

    count: int = 0
    reasons: List[str] = field(default_factory=list)

    def add(self, reason: str) -> None:
        self.count += 1
        if len(self.reasons) < MAX_SKIP_REASONS:
            self.reasons.append(reason)


class BadRowError(ValueError):
    """A malformed row; the message names the file, the 1-based row, the problem and the fix."""


def _check_row(
    obj: Any,
    prompt_key: str,
    label_key: str,
    base_dir: str = ".",
    images_limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
    max_images: int | None = None,
) -> Tuple[Optional[Row], str]:
    """(row, "") for a good row, (None, "problem. Fix: ...") for a bad one. Image parts are read (paths relative
    to ``base_dir``) and checked here, and counted against ``max_images`` (rollout.max_images_per_prompt)."""
    if not isinstance(obj, dict):
        return (
            None,
            f"expected a JSON object, got {type(obj).__name__}. Fix: write one object per line",
        )
    keys = sorted(map(str, obj))
    if prompt_key not in obj:
        return None, (
            f"missing prompt key {prompt_key!r} (row keys: {keys}). "
            f"Fix: add {prompt_key!r} to the row, or set data.prompt_key to the prompt column"
        )
    if obj[prompt_key] is None:
        return None, f"prompt {prompt_key!r} is null. Fix: give the row a prompt, or remove it"
    prompt, images = obj[prompt_key], []
    if isinstance(prompt, str):
        if not prompt.strip():
            return (
                None,
                f"prompt {prompt_key!r} is empty. Fix: give a non-empty prompt or remove the row",
            )
    elif isinstance(prompt, (list, tuple)):
        if not prompt:
            return (
                None,
                f"prompt {prompt_key!r} is an empty message list. Fix: give at least one message",
            )
        for i, m in enumerate(prompt):
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), (str, list, tuple))
            ):
                return None, (
                    f"message {i} of prompt {prompt_key!r} is {_short(m)}, not a "
                    '{"role": str, "content": str | [parts]} object. '
                    'Fix: write chat prompts as [{"role": "user", "content": "..."}, ...]'
                )
            if m["role"] not in CHAT_ROLES:
                return None, (
                    f"message {i} of prompt {prompt_key!r} has role {m['role']!r}. "
                    f"Fix: use one of {', '.join(CHAT_ROLES)}"
                )
        try:
            prompt, images = split_images([dict(m) for m in prompt], base_dir, images_limits)
        except ValueError as e:  # BadImage included: the image's file, URL or problem, and the fix
            return None, f"prompt {prompt_key!r}, {e}"
        if max_images is not None and len(images) > max_images:
            return None, _too_many_images(len(images), max_images)
        if not images:  # text parts only: plain strings, which every chat template takes
            prompt = [
                {
                    **m,
                    "content": m["content"]
                    if isinstance(m["content"], str)
                    else "".join(p["text"] for p in m["content"]),
                }
                for m in prompt
            ]
    else:
        return None, (
            f"prompt {prompt_key!r} has type {type(prompt).__name__}; expected a string or a list of "
            '{"role", "content"} messages. Fix: convert the prompt column, or point data.prompt_key '
            "at the right column"
        )
    if label_key not in obj:
        return None, (
            f"missing label key {label_key!r} (row keys: {keys}). "
            f"Fix: add {label_key!r} to the row, or set data.label_key to the label column"
        )
    if obj[label_key] is None:
        return None, f"label {label_key!r} is null. Fix: give the row a label, or remove it"
    row = {"prompt": prompt, "label": obj[label_key]}
    if images:
        row["images"] = images
    columns = {str(k): v for k, v in obj.items() if k not in (prompt_key, label_key)}
    # the row's other columns: a reward function gets them by name (rlmega/judgers/native.py)
    if columns:
        row["columns"] = columns
    return row, ""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonl_objects(path: str) -> Iterator[Tuple[str, Any, str]]:
    """("row R (line L)", parsed object or None, parse problem) for each non-blank line; rows are
    1-based and skip blank lines, lines are what an editor shows."""
    row = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            row += 1
            where = f"row {row}" if row == lineno else f"row {row} (line {lineno})"
            try:
                # utf-8-sig on the first line: editors that save "UTF-8 with BOM" put one there
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield (
                    where,
                    None,
                    f"not valid UTF-8 ({e.reason} at byte {e.start}). Fix: re-encode the file as UTF-8",
                )
                continue
            if row == 1 and line.lstrip().startswith("["):
                # A whole-file JSON array would fail on every line; say what is wrong once.
                raise BadRowError(
                    f"{path}, {where}: the file looks like a JSON array, not JSON Lines. "
                    "Fix: write one JSON object per line (e.g. with jq -c '.[]')"
                )
            try:
                yield where, json.loads(line), ""
            except json.JSONDecodeError as e:
                yield (
                    where,
                    None,
                    (
                        f"invalid JSON ({e.msg} at column {e.colno}). "
                        "Fix: make each line one complete JSON object"
                    ),
                )


def _parquet_objects(path: str, prompt_key: str, label_key: str) -> Iterator[Tuple[str, Any, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is a core dependency
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid & co. name no file
        raise BadRowError(
            f"{path}: not a readable Parquet file ({type(e).__name__}: {e}). Fix: write it with "
            "pandas.DataFrame.to_parquet or pyarrow, or use JSON Lines (.jsonl)"
        ) from e
    columns = pf.schema_arrow.names
    for key, what in ((prompt_key, "prompt"), (label_key, "label")):
        # a file-level problem: no row could be good, so skipping makes no sense
        if key not in columns:
            raise BadRowError(
                f"{path}: no {what} column {key!r} (columns: {columns}). "
                f"Fix: set data.{what}_key to one of the columns"
            )
    row = 0
    for batch in pf.iter_batches():  # every column: the others go to the reward function by name
        for obj in batch.to_pylist():
            row += 1
            yield f"row {row}", obj, ""


def load_rows(
    path: str,
    prompt_key: str = "prompt",
    label_key: str = "label",
    on_bad_row: str = "error",
    images: ImageLimits = DEFAULT_IMAGE_LIMITS,
    max_images: int | None = None,
) -> Tuple[List[Row], Skipped]:
    """Read prompt rows from a JSONL or Parquet (.parquet) file.

    Returns (rows, skipped): rows as {"prompt": str | messages, "label": value}, in file order.
    A malformed row raises BadRowError (a ValueError) naming the file and its 1-based row number
    when on_bad_row="error" (JSONL: blank lines are not rows; the line is named too); with "skip" it
    is left out and counted in `skipped`. A file with no usable row is an error in both modes.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row={on_bad_row!r}; use 'error' or 'skip'")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"prompt file {path!r} does not exist. Fix: set data.train_path/eval_path "
            "to an existing JSONL or Parquet file, or to \"\" for the synthetic task"
        )
    suffix = os.path.splitext(path)[1].lower()
    if suffix in PARQUET_SUFFIXES:
        objects = _parquet_objects(path, prompt_key, label_key)
    elif suffix in JSONL_SUFFIXES:
        objects = _jsonl_objects(path)
    else:
        raise ValueError(
            f"{path}: unknown prompt file type {suffix!r}. "
            f"Fix: use JSON Lines ({', '.join(JSONL_SUFFIXES)}) "
            f"or Parquet ({', '.join(PARQUET_SUFFIXES)})"
        )

    rows: List[Row] = []
    skipped = Skipped()
    for where, obj, problem in objects:
        row = None
        if not problem:
            row, problem = _check_row(
                obj,
                prompt_key,
                label_key,
                os.path.dirname(os.path.abspath(path)),
                images,
                max_images,
            )
        if row is not None:
            row["where"] = f"{path}, {where}"  # for problems found later (tokenization, length)
            rows.append(row)
        elif on_bad_row == "error":
            raise BadRowError(
                f"{path}, {where}: {problem} (or set data.on_bad_row=skip to skip bad rows)"
            )
        else:
            skipped.add(f"{path}, {where}: {problem}")

    if skipped.count:
        logger.warning(
            "%s: skipped %d bad row(s); first: %s", path, skipped.count, skipped.reasons[0]
        )
    if not rows:
        why = (
            f"; all {skipped.count} rows were bad, e.g. {skipped.reasons[0]}"
            if skipped.count
            else " (empty file)"
        )
        raise ValueError(f"{path}: no usable prompt rows{why}")
    return rows, skipped


def synthetic_arithmetic_rows(n: int, digits: int = 2, seed: int = 0) -> List[Row]:
    """n addition problems as rows: {"prompt": "12+34=", "label": "46"} (rlmega.data.arithmetic)."""
    return [{"prompt": p, "label": a} for p, a in make_problems(n, digits=digits, seed=seed)]


@dataclass(frozen=True)
class Prompt:
    index: int
    """Position of the row in the `rows` given to PromptDataset (stable under length filtering)."""
    token_ids: List[int]
    """The prompt as the engine receives it (chat template applied where asked)."""
    label: Any
    """The row's label, passed to the reward function."""
    text: str
    """The prompt text the token ids encode (the rendered chat for message prompts)."""
    images: Tuple[bytes, ...] = ()
    """A vision-language prompt's images (encoded files), in the order of their placeholders."""
    engine_ids: Optional[List[int]] = None
    """With images: the ids the engine is given, one image placeholder per image, which it expands into
    ``token_ids`` (the processor's expansion, what the trainer scores). None: ``token_ids``."""
    columns: Dict[str, Any] = field(default_factory=dict)
    """The row's other columns (not the prompt's nor the label's), for the reward function."""

    def request_ids(self) -> List[int]:
        """What an engine request carries (``engine_ids`` for an image prompt)."""
        return list(self.engine_ids if self.engine_ids is not None else self.token_ids)


class PromptDataset:
    """Rows tokenized once; prompts longer than max_prompt_tokens are dropped and counted.

    Message-list prompts go through the tokenizer's chat template with a generation prompt; a string
    prompt does too when apply_chat_template=True (as one user message), and is otherwise encoded as
    is, without special tokens. `dataset[i]` is a Prompt; `num_filtered` counts the dropped prompts
    (too long, or empty after tokenization).
    """

    def __init__(
        self,
        rows: Sequence[Row],
        tokenizer,
        max_prompt_tokens: int,
        apply_chat_template: bool = False,
        source: str = "prompt rows",
        strict: bool = False,
        processor=None,
        max_images: int = 0,
    ):
        """``strict``: a prompt that is too long, or loses characters the tokenizer cannot represent,
        is an error naming its row; otherwise it is counted and warned about (with the first rows).
        ``processor``: a vision-language model's (AutoProcessor), which rows with images need; ``max_images``:
        the most images a prompt may have (rollout.max_images_per_prompt), more is an error naming the row."""
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens} must be >= 1")
        self.max_prompt_tokens = max_prompt_tokens
        self.source = source
        self._prompts: List[Prompt] = []
        self.num_filtered = 0
        self.num_lossy = 0  # prompts whose characters did not all survive tokenization (kept)
        too_long, lossy, lengths = [], [], []
        for index, row in enumerate(rows):
            where = row.get("where", f"{source}, row {index + 1}")
            images = tuple(row.get("images") or ())
            engine_ids = None
            if images:
                _check_images(where, len(images), processor, max_images)
                text, engine_ids, ids = _tokenize_with_images(processor, row["prompt"], images)
            else:
                text, ids = self._tokenize(tokenizer, row["prompt"], apply_chat_template)
            lengths.append(len(ids))
            if 0 < len(ids) <= max_prompt_tokens:
                self._prompts.append(
                    Prompt(
                        index=index,
                        token_ids=ids,
                        label=row["label"],
                        text=text,
                        images=images,
                        engine_ids=engine_ids,
                        columns=row.get("columns") or {},
                    )
                )
                if _lost_characters(tokenizer, text, engine_ids or ids):
                    lossy.append(where)
            else:
                self.num_filtered += 1
                too_long.append(f"{where} ({len(ids)} tokens)")
        self.num_lossy = len(lossy)
        problems = [
            (
                too_long,
                f"longer than max_prompt_tokens={max_prompt_tokens} (or empty)",
                "raise rollout.max_prompt_tokens, shorten or remove those rows",
                "dropped",
            ),
            (
                lossy,
                "with characters the tokenizer cannot represent (they would be dropped silently)",
                "use a model whose tokenizer covers them, or clean the text",
                "kept without them",
            ),
        ]
        for found, what, fix, done in problems:
            if found and strict:
                raise BadRowError(
                    f"{found[0]}: prompt {what}; {len(found)} such prompt(s) in {source}, e.g. "
                    f"{', '.join(found[:3])}. Fix: {fix} (or set data.strict=false to go on)"
                )
            if found:
                logger.warning(
                    "%s: %d of %d prompts %s, %s; first: %s",
                    source,
                    len(found),
                    len(lengths),
                    what,
                    done,
                    "; ".join(found[:3]),
                )
        if not self._prompts:
            if not lengths:
                raise ValueError(f"{source}: no prompts to tokenize")
            shortest = min((n for n in lengths if n > 0), default=0)
            fix = (
                f"raise rollout.max_prompt_tokens to at least {shortest}, or use shorter prompts"
                if shortest
                else "check that the tokenizer covers the prompts' characters"
            )
            raise ValueError(
                f"{source}: none of the {len(lengths)} prompts fits max_prompt_tokens="
                f"{max_prompt_tokens} (token lengths {shortest}..{max(lengths)}). Fix: {fix}"
            )

    @staticmethod
    def _tokenize(
        tokenizer, prompt: Union[str, Messages], apply_chat_template: bool
    ) -> Tuple[str, List[int]]:
        if isinstance(prompt, str) and not apply_chat_template:
            return prompt, list(tokenizer.encode(prompt, add_special_tokens=False))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat template, needed for chat-message prompts and "
                "data.apply_chat_template=true. Fix: use plain string prompts with "
                "data.apply_chat_template=false, or a model whose tokenizer has a chat template"
            )
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        # older transformers ignore return_dict=False
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, [int(t) for t in ids]

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self._prompts[i]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self._prompts)


def _check_images(where: str, count: int, processor, max_images: int) -> None:
    if processor is None:
        raise BadRowError(
            f"{where}: the prompt has {count} image(s), but model.path is a text-only model (no image "
            "processor). Fix: use a vision-language model.path, or drop the image parts"
        )
    if count > max_images:
        raise BadRowError(f"{where}: {_too_many_images(count, max_images)}")


def _too_many_images(count: int, max_images: int) -> str:
    return (
        f"the prompt has {count} images, over rollout.max_images_per_prompt={max_images} (the engines' "
        f"limit_mm_per_prompt). Fix: raise rollout.max_images_per_prompt to {count}, or give the prompt fewer "
        "images"
    )


def _tokenize_with_images(
    processor, messages: Messages, images: Tuple[bytes, ...]
) -> Tuple[str, List[int], List[int]]:
    """(rendered chat, ids with one placeholder per image for the engine, the processor's expanded ids)."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    engine_ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    _, ids = processor_vision(processor, text, images)
    return text, [int(t) for t in engine_ids], ids


def _lost_characters(tokenizer, text: str, ids: List[int]) -> bool:
    """True when decoding the ids does not give the text back: the tokenizer dropped characters
    (an unknown-token id decodes to its placeholder, also a change). Whitespace the tokenizer
    normalises is not a loss worth a warning, so it is ignored."""
    back = tokenizer.decode(ids, skip_special_tokens=False)
    return "".join(back.split()) != "".join(text.split())


class PromptSampler:
    """Batches of dataset indices in a seeded order; epoch e is permutation(seed + e) (or 0..n-1).

    Batches run across epoch boundaries, so every batch is full: the last batch of an epoch is
    topped up from the start of the next one. `state_dict()` holds (epoch, position) plus what the
    order depends on; loading it continues the exact index sequence of an uninterrupted run.
    """

    def __init__(self, dataset_len: int, batch_size: int, shuffle: bool = True, seed: int = 0):
        if dataset_len < 1 or batch_size < 1:
            raise ValueError(
                f"need dataset_len >= 1 and batch_size >= 1, got {dataset_len}, {batch_size}"
            )
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        self.dataset_len, self.batch_size, self.shuffle, self.seed = (
            dataset_len,
            batch_size,
            shuffle,
            seed,
        )
        self.epoch = 0
        self.position = 0  # next index within this epoch's order
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> List[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        return np.random.default_rng(self.seed + epoch).permutation(self.dataset_len).tolist()

    def next_batch(self) -> List[int]:
        out: List[int] = []
        while len(out) < self.batch_size:
            take = min(self.batch_size - len(out), self.dataset_len - self.position)
            out += self._order[self.position : self.position + take]
            self.position += take
            if self.position == self.dataset_len:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from `state`; the batch size may differ, the order-defining settings may not."""
        for key in ("seed", "shuffle", "dataset_len"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r}, but this sampler has "
                    f"{key}={getattr(self, key)!r}; resuming would draw different prompts. Fix: resume with "
                    f"the same data settings (data.seed, data.shuffle, dataset and max_prompt_tokens)"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.dataset_len:
            raise ValueError(
                f"sampler state epoch={epoch}, position={position} is out of range "
                f"for a dataset of {self.dataset_len}"
            )
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)


SYNTHETIC_EVAL_SIZE = 100  # held-out problems for evaluating the synthetic task


def _synthetic_eval_rows(cfg, train_rows: Sequence[Row]) -> List[Row]:
    """Problems from seed + 1 that are not training prompts; overlapping ones only when nothing is left
    (1-digit addition has just 100 problems)."""
    seen = {r["prompt"] for r in train_rows}
    held, fresh = [], set()
    for row in synthetic_arithmetic_rows(
        4 * SYNTHETIC_EVAL_SIZE, cfg.synthetic_digits, cfg.seed + 1
    ):
        if row["prompt"] not in seen and row["prompt"] not in fresh:
            fresh.add(row["prompt"])
            held.append(row)
    if not held:
        logger.warning(
            "synthetic eval set: every problem is also a training prompt; evaluating on seen problems"
        )
        return synthetic_arithmetic_rows(SYNTHETIC_EVAL_SIZE, cfg.synthetic_digits, cfg.seed + 1)
    return held[:SYNTHETIC_EVAL_SIZE]


def synthetic_rows(cfg, split: str) -> Tuple[List[Row], str]:
    """(rows, source name) of cfg.synthetic_task's `split`: cfg.synthetic_size training problems (seed
    cfg.seed); for eval, SYNTHETIC_EVAL_SIZE held-out arithmetic problems, the sequence task's eval
    start letters, or SYNTHETIC_EVAL_SIZE coloured-shape images of another seed."""
    if cfg.synthetic_task == "shapes":
        evaluating = split == "eval"
        rows = shape_rows(
            SYNTHETIC_EVAL_SIZE if evaluating else cfg.synthetic_size, cfg.seed, eval_set=evaluating
        )
        return rows, "synthetic shapes" + (" (held out)" if evaluating else "")
    if cfg.synthetic_task == "sequence":
        evaluating = split == "eval"
        n = SYNTHETIC_EVAL_SIZE if evaluating else cfg.synthetic_size
        rows = [
            {"prompt": p, "label": a}
            for p, a in make_sequence_problems(
                n, cfg.synthetic_length, cfg.seed, eval_set=evaluating
            )
        ]
        return rows, "synthetic sequences" + (" (eval starts)" if evaluating else "")
    rows = synthetic_arithmetic_rows(cfg.synthetic_size, cfg.synthetic_digits, cfg.seed)
    if split == "eval":
        return _synthetic_eval_rows(cfg, rows), "synthetic arithmetic (held out)"
    return rows, "synthetic arithmetic"


def load_prompt_dataset(
    cfg,
    tokenizer,
    max_prompt_tokens: int,
    split: str = "train",
    processor=None,
    max_images: int = 0,
) -> Optional[PromptDataset]:
    """The `split` ("train" or "eval") dataset a DataConfig describes.

    train_path "" gives cfg.synthetic_task's problems (``synthetic_rows``); eval is None when only the
    training prompts come from a file. ``processor``, ``max_images``: PromptDataset's (image prompts).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}; use 'train' or 'eval'")
    path = cfg.train_path if split == "train" else cfg.eval_path
    if path:
        limits = ImageLimits(cfg.max_image_pixels, cfg.max_image_bytes, cfg.image_urls)
        rows, _ = load_rows(path, cfg.prompt_key, cfg.label_key, cfg.on_bad_row, limits, max_images)
        source = path
    elif cfg.train_path:
        return None
    else:
        rows, source = synthetic_rows(cfg, split)
    return PromptDataset(
        rows,
        tokenizer,
        max_prompt_tokens,
        cfg.apply_chat_template,
        source=source,
        strict=cfg.strict,
        processor=processor,
        max_images=max_images,
    )


class PromptData:
    """What the RL driver needs from the data section: the step's prompts, warm-start and eval prompts,
    and a checkpointable position.

        data = load_prompt_data(cfg.data, tokenizer, cfg.rollout.max_prompt_tokens, cfg.trainer.prompts_per_step)
        prompts = data.next_prompts()                      # list[Prompt], prompts_per_step of them
        extra = {"data": data.state_dict()}                # into the checkpoint; data.load_state_dict(...) on resume
    """

    def __init__(
        self,
        train: PromptDataset,
        eval: Optional[PromptDataset],
        prompts_per_step: int,
        shuffle: bool = True,
        seed: int = 0,
    ):
        self.train, self.prompts_per_step = train, prompts_per_step
        self.eval_prompts: List[Prompt] = list(eval) if eval is not None else []
        self.sampler = PromptSampler(len(train), prompts_per_step, shuffle, seed)
        # Warm-start batches come from their own fixed order, so they never move the RL sampler.
        self._warmup_order = (
            np.random.default_rng(seed).permutation(len(train)).tolist()
            if shuffle
            else list(range(len(train)))
        )

    def next_prompts(self) -> List[Prompt]:
        return [self.train[i] for i in self.sampler.next_batch()]

    def warmup_prompts(self, i: int) -> List[Prompt]:
        """The i-th supervised warm-start batch (prompts_per_step prompts; a pure function of i)."""
        n, b = len(self.train), self.prompts_per_step
        return [self.train[self._warmup_order[(i * b + k) % n]] for k in range(b)]

    def state_dict(self) -> Dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


def load_prompt_data(
    cfg,
    tokenizer,
    max_prompt_tokens: int,
    prompts_per_step: int,
    processor=None,
    max_images: int = 0,
) -> PromptData:
    """PromptData for a DataConfig: its train and eval datasets and a sampler seeded by cfg.seed (``processor``,
    ``max_images``: image prompts, PromptDataset)."""
    return PromptData(
        load_prompt_dataset(cfg, tokenizer, max_prompt_tokens, "train", processor, max_images),
        load_prompt_dataset(cfg, tokenizer, max_prompt_tokens, "eval", processor, max_images),
        prompts_per_step,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
    )

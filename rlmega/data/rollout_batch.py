"""RolloutBatch: the contract between rollout, reward, advantage and training code.

N samples, each one prompt followed by one sampled response. Per-token fields are ragged
lists (one tensor per sample) over the *response* tokens only, so a field never needs a
padding convention; packing for the model is ``rlmega.data.packing``'s job. The exceptions:
``routed_experts`` (MoE routing replay), one row per token of prompt + response, and ``vision`` (a
vision-language model's images), each sample's processor outputs.

    batch = RolloutBatch(tokens=[...], prompt_lens=..., response_mask=[...],
                         group_ids=..., sample_ids=...)
    parts = batch.split(dp_size)                       # contiguous shards
    batch = dataclasses.replace(batch, rewards=r)      # adds a field, re-validated
    batch.save("runs/x/rollout_000.safetensors"); RolloutBatch.load(...)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

# Per-sample tensors of shape (L_i - P_i,), one per response token.
RESPONSE_FIELDS = (
    "response_mask",
    "rollout_logprobs",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "returns",
    "old_values",
)
# Tensors of shape (N,), one value per sample.
SAMPLE_FIELDS = ("prompt_lens", "rewards", "group_ids", "sample_ids")
# Per-sample tensors of shape (L_i, num_moe_layers, topk) int16, one row per token of prompt + response.
TOKEN_FIELDS = ("routed_experts",)
# Per-sample {name: tensor} or None: a vision-language model's processor outputs of the sample's prompt.
VISION_FIELDS = ("vision",)
# A vision dict's key for a sample's image observations (a tool's image answers in the response,
# rlmega/agents/image_observations.py): (k, 2) int64 [start, end) offsets from the response's first token.
OBSERVATION_SPANS = "observation_spans"
OPTIONAL_FIELDS = (
    "rollout_logprobs",
    "rewards",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "returns",
    "old_values",
    "routed_experts",
    "vision",
)
_INT_FIELDS = ("tokens", "prompt_lens", "group_ids", "sample_ids")
_FORMAT = "rlmega.RolloutBatch"
_VERSION = 1


@dataclasses.dataclass(kw_only=True, eq=False)
class RolloutBatch:
    """N samples (prompt + response). L_i = total tokens, P_i = prompt tokens of sample i."""

    tokens: list[torch.Tensor]
    """Per sample (L_i,) int64: prompt tokens followed by response tokens."""
    prompt_lens: torch.Tensor
    """(N,) int64, P_i in [1, L_i]: a prompt needs >= 1 token to score the first response token."""
    response_mask: list[torch.Tensor]
    """Per sample (L_i - P_i,) float32, 1.0 where the token counts for the loss (0: tool output, truncation)."""
    group_ids: torch.Tensor
    """(N,) int64; samples drawn from the same prompt share it (GRPO/RLOO baselines)."""
    sample_ids: torch.Tensor
    """(N,) int64, unique and stable across select/split/concat/save."""
    rollout_logprobs: list[torch.Tensor] | None = None
    """Per sample (L_i - P_i,) float32: the inference engine's log-prob of each response token."""
    rewards: torch.Tensor | None = None
    """(N,) float32, one scalar reward per sample."""
    advantages: list[torch.Tensor] | None = None
    """Per sample (L_i - P_i,) float32."""
    old_logprobs: list[torch.Tensor] | None = None
    """Per sample (L_i - P_i,) float32: the training policy's log-probs before the update."""
    ref_logprobs: list[torch.Tensor] | None = None
    """Per sample (L_i - P_i,) float32: the reference policy's log-probs (KL penalty)."""
    returns: list[torch.Tensor] | None = None
    """Per sample (L_i - P_i,) float32: the critic's regression targets (GAE returns; 0 on masked tokens)."""
    old_values: list[torch.Tensor] | None = None
    """Per sample (L_i - P_i,) float32: the critic's values before its update (the value clip's centre)."""
    routed_experts: list[torch.Tensor] | None = None
    """Per sample (L_i, num_moe_layers, topk) int16 (MoE routing replay): row j holds the experts
    (model-global ids, model-wide MoE layer order) that token j of prompt + response was routed to;
    -1 rows where no route was recorded (the last sampled token, which the engine never processes;
    tool-output tokens): the trainer routes those with its live router. num_moe_layers and topk are
    the same for every sample."""
    vision: list[dict | None] | None = None
    """Per sample, a vision-language model's processor outputs for its prompt's images without the token ids
    ({"pixel_values": ..., "image_grid_thw" | "pixel_attention_mask": ...}: rlmega/fsdp/vision_inputs.py),
    or None for a sample without images. Samples of one prompt may share the same tensors."""

    def __post_init__(self):
        # Tuples are accepted at construction; lists are what every method returns.
        for name in ("tokens",) + RESPONSE_FIELDS + TOKEN_FIELDS + VISION_FIELDS:
            value = getattr(self, name)
            if isinstance(value, tuple):
                setattr(self, name, list(value))
        self.validate()

    # ---- sizes -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    def lengths(self) -> list[int]:
        """L_i for each sample: prompt + response tokens."""
        return [int(t.numel()) for t in self.tokens]

    def response_lens(self) -> list[int]:
        """L_i - P_i for each sample."""
        return [length - int(p) for length, p in zip(self.lengths(), self.prompt_lens.tolist())]

    def num_tokens(self) -> int:
        return sum(self.lengths())

    def num_response_tokens(self) -> int:
        return sum(self.response_lens())

    def response_tokens(self) -> list[torch.Tensor]:
        """Per sample (L_i - P_i,) int64 views of the response part of ``tokens``."""
        return [t[int(p) :] for t, p in zip(self.tokens, self.prompt_lens.tolist())]

    # ---- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every shape/dtype invariant; ValueError names the field and sample index."""
        if not isinstance(self.tokens, list):
            raise ValueError(
                f"tokens must be a list of 1-D tensors, got {type(self.tokens).__name__}"
            )
        n = len(self.tokens)
        for i, t in enumerate(self.tokens):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"tokens[{i}] must be a 1-D tensor, got {_describe(t)}")
            if t.dtype != torch.int64:
                raise ValueError(f"tokens[{i}] must be int64, got {t.dtype} (fix: .long())")

        for name in SAMPLE_FIELDS:
            value = getattr(self, name)
            if value is None and name in OPTIONAL_FIELDS:
                continue
            if not isinstance(value, torch.Tensor) or value.shape != (n,):
                raise ValueError(
                    f"{name} must be a tensor of shape ({n},) for {n} samples, got {_describe(value)}"
                )
            want = torch.int64 if name in _INT_FIELDS else torch.float32
            if value.dtype != want:
                raise ValueError(f"{name} must be {want}, got {value.dtype}")

        prompt_lens = self.prompt_lens.tolist()
        for i, (t, p) in enumerate(zip(self.tokens, prompt_lens)):
            if not 1 <= p <= t.numel():
                raise ValueError(
                    f"prompt_lens[{i}] = {p} must be in [1, {t.numel()}] (sample {i} has {t.numel()} tokens)"
                )
        seen = set()
        for i, s in enumerate(self.sample_ids.tolist()):
            if s in seen:
                raise ValueError(
                    f"sample_ids must be unique: sample_ids[{i}] = {s} repeats an earlier id"
                )
            seen.add(s)

        response_lens = [t.numel() - p for t, p in zip(self.tokens, prompt_lens)]
        for name in RESPONSE_FIELDS:
            value = getattr(self, name)
            if value is None and name in OPTIONAL_FIELDS:
                continue
            if not isinstance(value, list) or len(value) != n:
                raise ValueError(
                    f"{name} must be a list of {n} tensors (one per sample), got {_describe(value)}"
                )
            for i, (v, r) in enumerate(zip(value, response_lens)):
                if not isinstance(v, torch.Tensor) or v.dim() != 1:
                    raise ValueError(f"{name}[{i}] must be a 1-D tensor, got {_describe(v)}")
                if v.numel() != r:
                    raise ValueError(
                        f"{name}[{i}] has {v.numel()} tokens, sample {i} has {r} response tokens"
                    )
                if v.dtype != torch.float32:
                    raise ValueError(f"{name}[{i}] must be float32, got {v.dtype} (fix: .float())")
        for i, m in enumerate(self.response_mask):
            if not bool(((m == 0) | (m == 1)).all()):
                raise ValueError(f"response_mask[{i}] must hold only 0.0 and 1.0")
        self._validate_routes(n)
        self._validate_vision(n)

    def _validate_vision(self, n: int) -> None:
        if self.vision is None:
            return
        if not isinstance(self.vision, list) or len(self.vision) != n:
            raise ValueError(
                f"vision must be a list of {n} dicts or None (one per sample), "
                f"got {_describe(self.vision)}"
            )
        for i, v in enumerate(self.vision):
            if v is not None and not (
                isinstance(v, dict)
                and v
                and all(
                    isinstance(k, str) and "/" not in k and isinstance(t, torch.Tensor)
                    for k, t in v.items()
                )
            ):
                raise ValueError(
                    f"vision[{i}] must be None or a non-empty {{name: tensor}} dict, got {_describe(v)}"
                )

    def _validate_routes(self, n: int) -> None:
        routes = self.routed_experts
        if routes is None:
            return
        if not isinstance(routes, list) or len(routes) != n:
            raise ValueError(
                f"routed_experts must be a list of {n} tensors (one per sample), got {_describe(routes)}"
            )
        layout = None
        for i, (r, t) in enumerate(zip(routes, self.tokens)):
            if not isinstance(r, torch.Tensor) or r.dim() != 3 or r.shape[0] != t.numel():
                raise ValueError(
                    f"routed_experts[{i}] must have shape ({t.numel()}, num_moe_layers, topk) for sample {i} "
                    f"of {t.numel()} tokens, got {_describe(r)}"
                )
            if r.dtype != torch.int16:
                raise ValueError(
                    f"routed_experts[{i}] must be int16, got {r.dtype} (fix: .to(torch.int16))"
                )
            if layout is None:
                layout = tuple(r.shape[1:])
            elif tuple(r.shape[1:]) != layout:
                raise ValueError(
                    f"routed_experts[{i}] has (num_moe_layers, topk) = {tuple(r.shape[1:])}, "
                    f"routed_experts[0] has {layout}: every sample must come from the same model"
                )
            if r.numel() and int(r.min()) < -1:
                raise ValueError(
                    f"routed_experts[{i}] holds {int(r.min())}: expert ids are >= 0, -1 = no route"
                )

    # ---- reshaping ---------------------------------------------------------------------------
    def select(self, indices: Sequence[int] | torch.Tensor) -> RolloutBatch:
        """A new batch of the samples at ``indices``, in that order, with every field kept."""
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        idx = [int(i) for i in indices]
        n = len(self)
        for i in idx:
            if not 0 <= i < n:
                raise IndexError(f"select: index {i} out of range for a batch of {n} samples")
        index = torch.tensor(idx, dtype=torch.int64)
        fields = {"tokens": [self.tokens[i] for i in idx]}
        for name in SAMPLE_FIELDS:
            value = getattr(self, name)
            fields[name] = None if value is None else value[index]
        for name in RESPONSE_FIELDS + TOKEN_FIELDS + VISION_FIELDS:
            value = getattr(self, name)
            fields[name] = None if value is None else [value[i] for i in idx]
        return RolloutBatch(**fields)

    def split(self, n_parts: int) -> list[RolloutBatch]:
        """``n_parts`` contiguous shards; sizes differ by at most one (earlier shards larger)."""
        if n_parts < 1:
            raise ValueError(f"split: n_parts must be >= 1, got {n_parts}")
        base, extra = divmod(len(self), n_parts)
        parts, start = [], 0
        for k in range(n_parts):
            size = base + (1 if k < extra else 0)
            parts.append(self.select(range(start, start + size)))
            start += size
        return parts

    @staticmethod
    def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Samples of all ``batches`` in order; an optional field must be set in all or none."""
        if not batches:
            raise ValueError("concat: need at least one batch")
        fields = {"tokens": [t for b in batches for t in b.tokens]}
        for name in SAMPLE_FIELDS + RESPONSE_FIELDS + TOKEN_FIELDS + VISION_FIELDS:
            present = [getattr(b, name) is not None for b in batches]
            if not all(present):
                if any(present):
                    missing = present.index(False)
                    raise ValueError(
                        f"concat: {name} is set in some batches but not in batch {missing}"
                    )
                fields[name] = None
            elif name in SAMPLE_FIELDS:
                fields[name] = torch.cat([getattr(b, name) for b in batches])
            else:
                fields[name] = [v for b in batches for v in getattr(b, name)]
        return RolloutBatch(**fields)

    # ---- persistence -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """One safetensors file: ragged fields flattened, plus lengths; written atomically."""
        lengths = torch.tensor(self.lengths(), dtype=torch.int64)
        tensors = {"lengths": lengths, "tokens": _flat(self.tokens, torch.int64)}
        present = []
        for name in SAMPLE_FIELDS + RESPONSE_FIELDS + TOKEN_FIELDS + VISION_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            present.append(name)
            if name in SAMPLE_FIELDS:
                tensors[name] = value.contiguous()
            elif name in TOKEN_FIELDS:
                # (sum L_i, M, K); an empty batch loses (M, K), which nothing can then need.
                tensors[name] = (
                    torch.cat(value).contiguous()
                    if value
                    else torch.zeros(0, 0, 0, dtype=torch.int16)
                )
            # sample i's tensors as "vision/i/name"; a sample without any: None
            elif name in VISION_FIELDS:
                # clone: samples of one prompt share tensors, which safetensors refuses to save twice
                tensors.update(
                    {
                        f"{name}/{i}/{k}": t.contiguous().clone()
                        for i, v in enumerate(value)
                        if v
                        for k, t in v.items()
                    }
                )
            else:
                tensors[name] = _flat(value, torch.float32)
        header = {"format": _FORMAT, "version": str(_VERSION), "fields": json.dumps(present)}
        data = st_save(tensors, metadata=header)
        path = os.fspath(path)
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RolloutBatch:
        """Inverse of ``save``; safetensors only parses tensors, it never runs code."""
        with open(path, "rb") as f:
            data = f.read()
        header = _read_metadata(data)
        if header.get("format") != _FORMAT or header.get("version") != str(_VERSION):
            raise ValueError(f"{path} is not an {_FORMAT} v{_VERSION} file (header: {header})")
        tensors = st_load(data)
        lengths = tensors["lengths"].tolist()
        prompt_lens = tensors["prompt_lens"]
        response_lens = [length - p for length, p in zip(lengths, prompt_lens.tolist())]
        fields = {"tokens": list(torch.split(tensors["tokens"], lengths))}
        for name in json.loads(header["fields"]):
            value = tensors.get(name)  # a vision field is stored as one tensor per sample and name
            if name in SAMPLE_FIELDS:
                fields[name] = value
            elif name in TOKEN_FIELDS:
                fields[name] = list(torch.split(value, lengths))
            elif name in VISION_FIELDS:
                per: list[dict | None] = [None] * len(lengths)
                for key, t in tensors.items():
                    if key.startswith(f"{name}/"):
                        _, i, k = key.split("/", 2)
                        per[int(i)] = {**(per[int(i)] or {}), k: t}
                fields[name] = per
            else:
                fields[name] = list(torch.split(value, response_lens))
        return cls(**fields)


def _flat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Concatenate ragged 1-D tensors; an empty list gives an empty tensor of ``dtype``."""
    return torch.cat(parts).contiguous() if parts else torch.zeros(0, dtype=dtype)


def _read_metadata(data: bytes) -> dict:
    # safetensors layout: 8-byte little-endian header size, then a JSON header.
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__", {})


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__

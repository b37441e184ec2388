"""The FSDP critic's model: the policy's architecture as transformers' ``AutoModelForTokenClassification``.

One label, no bias and no dropout (rlmega/config/value_model.py): the HF body and ``score`` (hidden -> 1).
The head's output at position p is the value of the state before the token at p + 1, so the values sit on
the log-probs' prediction positions. Where the weights come from (model.path): a critic's export
(``XForTokenClassification``) loads whole; a causal LM (the policy) gives its body (``model.*``, its LM head
unused) and the head starts from ``fresh_value_head(hidden, head_std, model.seed)``, the draw the Megatron
critic starts from too; ``hf_config`` (a causal LM's config dict) builds a random body seeded by model.seed,
and the same head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlmega.config.schema import ModelConfig
from rlmega.config.value_model import (
    VALUE_HEAD,
    fresh_value_head,
    head_std,
    is_value_model,
    value_model_config,
)
from rlmega.fsdp import packed_attention, recurrent_layers


def value_model(model_cfg: ModelConfig, hf_config: dict | None) -> torch.nn.Module:
    """The full value model on the CPU in float32 (master weights; bf16 is FSDP's compute cast), with the
    packed attention of the policy's (FSDPModelManager.model_provider_func)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    kw = {"dtype": torch.float32, "attn_implementation": packed_attention.NAME}
    source = (
        dict(hf_config)
        if hf_config is not None
        else json.loads((Path(model_cfg.path) / "config.json").read_text())
    )
    hf = value_model_config(source)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    if hf_config is not None:
        with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left where it was
            torch.manual_seed(model_cfg.seed)
            model = AutoModelForTokenClassification.from_config(config, **kw)
    else:
        # A causal LM's checkpoint fills the body (the same "model." prefix); its lm_head is left out.
        model, info = AutoModelForTokenClassification.from_pretrained(
            model_cfg.path, config=config, local_files_only=True, output_loading_info=True, **kw
        )
        # a policy has no value head to load
        fresh = set() if is_value_model(source) else {VALUE_HEAD}
        missing = set(info["missing_keys"]) - fresh
        # transformers would have left them at random init without a word beyond a warning
        if missing:
            raise RuntimeError(
                f"{model_cfg.path}: the value model's {sorted(missing)} are not in its checkpoint"
            )
        if is_value_model(source):
            recurrent_layers.restart_at_sequences(model)
            return model  # a critic's export: its own head
    # linear-attention state restarts per packed sequence
    recurrent_layers.restart_at_sequences(model)
    hidden = config.get_text_config().hidden_size
    with torch.no_grad():  # not transformers' init: the seeded draw both backends share
        model.score.weight.copy_(fresh_value_head(hidden, head_std(source), model_cfg.seed))
    return model

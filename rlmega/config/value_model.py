"""A value model's (critic's) Hugging Face form: the policy's architecture as ``XForTokenClassification``
with one label, no bias, no dropout, and the seeded fresh head both backends start from.

    hf = value_model_config(policy_hf_config)   # config.json of a critic made from the policy
    causal = causal_lm_config(hf)               # the policy-shaped config the Megatron mapping reads
    w = fresh_value_head(hidden_size, std=0.02, seed=1234)   # (1, hidden) float32

transformers builds it as ``AutoModelForTokenClassification`` (the HF body + ``score``: hidden -> 1),
which is how verl's FSDP critic is made; on Megatron the same weights are a GPTModel whose output layer
is a hidden -> 1 projection (rlmega/megatron/critic.py). ``score.weight`` is the value head in both.
No ``score.bias`` (token_classification_bias=False) and no dropout (classifier_dropout=0.0): the
value is one dot product of the final-norm hidden state, the same on both backends and in every layout.
A critic made from a policy checkpoint (no ``score.weight``) starts from ``fresh_value_head``: a
normal(0, std) draw from a generator seeded with model.seed, so both backends start identically.
"""

from __future__ import annotations

_CAUSAL, _TOKEN = "ForCausalLM", "ForTokenClassification"
VALUE_HEAD = "score.weight"


def is_value_model(hf: dict) -> bool:
    """``hf`` (a config.json dict) describes a token-classification model (a critic's export)."""
    return any(a.endswith(_TOKEN) for a in hf.get("architectures") or [])


def value_model_config(hf: dict) -> dict:
    """The critic's config.json made from a causal LM's (or a critic's: returned normalised)."""
    archs = [a.replace(_CAUSAL, _TOKEN) for a in hf.get("architectures") or []]
    out = {k: v for k, v in hf.items() if k not in ("id2label", "label2id")}
    out.update(
        architectures=archs,
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        classifier_dropout=0.0,
        token_classification_bias=False,
        tie_word_embeddings=False,
    )  # no LM head to tie: the body's embedding stays its own
    return out


def causal_lm_config(hf: dict) -> dict:
    """The causal-LM config of a critic's (the body's shape; the Megatron mapping reads these)."""
    archs = [a.replace(_TOKEN, _CAUSAL) for a in hf.get("architectures") or []]
    drop = ("num_labels", "id2label", "label2id", "classifier_dropout", "token_classification_bias")
    return {
        **{k: v for k, v in hf.items() if k not in drop},
        "architectures": archs,
        "tie_word_embeddings": False,
    }


def fresh_value_head(hidden_size: int, std: float, seed: int):
    """(1, hidden_size) float32 tensor ~ normal(0, std), from its own generator (the caller's RNG untouched).
    torch is imported here: the config checks read this module without it."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(1, hidden_size, generator=g, dtype=torch.float32) * float(std)


def head_std(hf: dict) -> float:
    """The fresh head's std: the model's initializer_range (transformers' init of ``score``), else 0.02."""
    return float(hf.get("initializer_range", 0.02))

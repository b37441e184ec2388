"""HF DeepseekV3TopkRouter vs megatron-core 0.16.1 topk_routing_with_score_function (sigmoid, expert
bias, group-limited top-k, scaling), on random tokens, for several (experts, groups, topk, topk_group).

    python tools/spikes/deepseek_v3_router_check.py
"""

import warnings

import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

warnings.filterwarnings("ignore")


def check(E, G, k, kg, norm=True, tokens=4096, h=16, seed=0):
    cfg = DeepseekV3Config(
        hidden_size=h,
        n_routed_experts=E,
        n_group=G,
        num_experts_per_tok=k,
        topk_group=kg,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    r = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, h, generator=g) * 0.3)
        r.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    x = torch.randn(tokens, h, generator=g)
    logits, w, idx = r(x)
    hf = torch.zeros(tokens, E).scatter(1, idx, w)
    mc, _ = topk_routing_with_score_function(
        logits,
        k,
        num_groups=G,
        group_topk=kg,
        scaling_factor=2.5,
        score_function="sigmoid",
        expert_bias=r.e_score_correction_bias,
    )
    sel = ((hf > 0) != (mc > 0)).any(-1).float().mean().item()
    print(
        f"E={E:3d} n_group={G} topk={k} topk_group={kg} norm_topk_prob={norm!s:5}  "
        f"megatron group score = sum of top-{k // kg} (HF: top-2)  "
        f"tokens routed differently {sel:6.1%}  max|prob diff| {(hf - mc).abs().max().item():.2e}"
    )


torch.set_printoptions(precision=3)
check(8, 2, 2, 1)  # the tiny model
check(256, 8, 8, 4)  # DeepSeek-V3 / R1
check(64, 8, 6, 3)  # topk // topk_group = 2 as well
check(64, 8, 8, 2)  # topk // topk_group = 4 != 2: megatron scores groups differently
check(8, 4, 2, 2)  # topk // topk_group = 1: megatron takes each group's max
check(256, 8, 8, 4, norm=False)  # norm_topk_prob False: megatron's sigmoid path always renormalises
check(8, 1, 2, 1)  # n_group 1 (no group limit in effect)

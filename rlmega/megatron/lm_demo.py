"""Train a Megatron GPT with the tiny model's shape on arithmetic text, at TP2 x PP2.

The largest real thing the foundation has: Megatron model chunks, DDP, the distributed
optimizer and the 1F1B pipeline schedule on 4 gloo ranks (or NCCL on GPUs), printing the loss
per step. MegatronModelManager loads the tiny model's (random) HF weights into the chunks.

    python tools/make_tiny_model.py runs/demo/tiny_model --hidden-size 256 --num-heads 4 --num-kv-heads 2
    torchrun --standalone --nproc-per-node 4 -m rlmega.megatron.lm_demo --model runs/demo/tiny_model --tp 2 --pp 2

`rlmega demo` (and `make demo`) does both steps.
"""

import argparse
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from rlmega.config.schema import ModelConfig, OptimizerConfig, ParallelismConfig
from rlmega.data.arithmetic import make_problems
from rlmega.megatron import lm_step
from rlmega.megatron.model_manager import MegatronModelManager
from rlmega.megatron.runtime import data_parallel_rank_and_size, init_megatron, teardown_megatron


def token_rows(tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate texts (eos-separated) and cut into (N, seq_len+1) rows: no padding."""
    stream: list[int] = []
    for text in texts:
        stream += tokenizer.encode(text) + [tokenizer.eos_token_id]
    n = len(stream) // (seq_len + 1)
    return torch.tensor(stream[: n * (seq_len + 1)]).view(n, seq_len + 1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="HF folder from tools/make_tiny_model.py")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="rows per step (global batch)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    init_megatron(args.tp, args.pp, seed=0)
    rank0 = dist.get_rank() == 0
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    mm = MegatronModelManager(
        ModelConfig(path=args.model),
        ParallelismConfig(args.tp, args.pp, None, dist.get_world_size()),
        OptimizerConfig(lr=args.lr, clip_grad=1.0),
    )
    mm.setup_model_and_optimizer()
    config, model = mm.transformer_config, mm.model

    texts = [p + a for p, a in make_problems(4000, digits=2, seed=0)]
    train = token_rows(tokenizer, texts[:3600], args.seq_len)
    held_out = token_rows(tokenizer, texts[3600:], args.seq_len)[: args.batch]
    dp_rank, dp = data_parallel_rank_and_size()
    mine = lambda rows: rows.chunk(dp)[dp_rank]  # noqa: E731  this data-parallel rank's share

    start_eval = lm_step.lm_forward_backward(
        model, mine(held_out), args.micro_batch, forward_only=True
    )
    if rank0:
        print(
            f"rlmega demo: Megatron GPT {config.num_layers}x{config.hidden_size}, TP{args.tp} x PP{args.pp} "
            f"x DP{dp} on {dist.get_world_size()} ranks ({dist.get_backend()}); held-out loss {start_eval:.3f}",
            flush=True,
        )
    for step in range(args.steps):
        t0 = time.perf_counter()
        rows = train[(step * args.batch) % (len(train) - args.batch) :][: args.batch]
        loss = lm_step.lm_forward_backward(model, mine(rows), args.micro_batch)
        ok, grad_norm, _ = mm.optimizer_step()
        if rank0:
            print(
                f"step {step + 1:3d}/{args.steps}  loss {loss:.4f}  grad_norm {grad_norm:.3f}  "
                f"{time.perf_counter() - t0:.2f}s",
                flush=True,
            )
    end_eval = lm_step.lm_forward_backward(
        model, mine(held_out), args.micro_batch, forward_only=True
    )
    if rank0:
        print(f"held-out loss {start_eval:.3f} -> {end_eval:.3f}", flush=True)
    teardown_megatron()


if __name__ == "__main__":
    main()

"""Train a Megatron GPT with the tiny model's shape on arithmetic text, at TP2 x PP2.

The largest real thing the foundation has: Megatron model chunks, DDP, the distributed
optimizer and the 1F1B pipeline schedule on 4 gloo ranks (or NCCL on GPUs), printing the loss
per step. Weights start random (HF -> Megatron loading is the model manager's job).

    python tools/make_tiny_model.py runs/demo/tiny_model --hidden-size 256 --num-heads 4 --num-kv-heads 2
    torchrun --standalone --nproc-per-node 4 -m rlmega.lm_demo --model runs/demo/tiny_model --tp 2 --pp 2

`rlmega demo` (and `make demo`) does both steps.
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from rlmega.data.arithmetic import make_problems
from rlmega.megatron import lm_step
from rlmega.megatron.runtime import init_megatron, teardown_megatron


def token_rows(tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate texts (eos-separated) and cut into (N, seq_len+1) rows: no padding."""
    stream: list[int] = []
    for text in texts:
        stream += tokenizer.encode(text) + [tokenizer.eos_token_id]
    n = len(stream) // (seq_len + 1)
    return torch.tensor(stream[: n * (seq_len + 1)]).view(n, seq_len + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    hf = json.loads((Path(args.model) / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = -(-hf["vocab_size"] // args.tp) * args.tp  # pad so TP splits the vocabulary evenly
    config = lm_step.gpt_config(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        ffn_hidden_size=hf["intermediate_size"],
    )
    model, opt = lm_step.wrap_for_training(lm_step.build_gpt_chunks(config, vocab, args.seq_len), lr=args.lr)

    texts = [p + a for p, a in make_problems(4000, digits=2, seed=0)]
    train = token_rows(tokenizer, texts[:3600], args.seq_len)
    held_out = token_rows(tokenizer, texts[3600:], args.seq_len)[: args.batch]
    dp, dp_rank = lm_step.ps.get_data_parallel_world_size(), lm_step.ps.get_data_parallel_rank()
    mine = lambda rows: rows.chunk(dp)[dp_rank]  # noqa: E731  this data-parallel rank's share

    start_eval = lm_step.lm_forward_backward(model, mine(held_out), args.micro_batch, forward_only=True)
    if rank0:
        print(f"rlmega demo: Megatron GPT {config.num_layers}x{config.hidden_size}, TP{args.tp} x PP{args.pp} "
              f"x DP{dp} on {dist.get_world_size()} ranks ({dist.get_backend()}); held-out loss {start_eval:.3f}",
              flush=True)
    for step in range(args.steps):
        t0 = time.perf_counter()
        rows = train[(step * args.batch) % (len(train) - args.batch):][: args.batch]
        loss = lm_step.lm_forward_backward(model, mine(rows), args.micro_batch)
        ok, grad_norm, _ = opt.step()
        if rank0:
            print(f"step {step + 1:3d}/{args.steps}  loss {loss:.4f}  grad_norm {grad_norm:.3f}  "
                  f"{time.perf_counter() - t0:.2f}s", flush=True)
    end_eval = lm_step.lm_forward_backward(model, mine(held_out), args.micro_batch, forward_only=True)
    if rank0:
        print(f"held-out loss {start_eval:.3f} -> {end_eval:.3f}", flush=True)
    teardown_megatron()


if __name__ == "__main__":
    main()

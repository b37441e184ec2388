"""Write a tiny, randomly initialised Hugging Face model folder (no model hub needed).

Usage:
    python tools/make_tiny_model.py OUT_DIR [--arch qwen2|qwen3|qwen3_moe|mixtral|llama|phi3
                                                  |gemma3|olmo3|gpt_oss|deepseek_v3|qwen3_next
                                                  |idefics3|qwen2_vl] [--hidden-size 128]
        [--num-layers 4] [--num-heads 2] [--num-kv-heads 1] [--intermediate-size N]
        [--num-experts 8] [--top-k 2] [--moe-intermediate-size N]     (the mixture-of-experts archs)
        [--vocab-size N] [--tie-word-embeddings] [--seed 0] [--overwrite | --if-missing]

Both transformers and vLLM load the result; see rlmega/demo/tiny_model.py for what it contains, and
rlmega/demo/tiny_vlm.py for the vision-language archs (idefics3, qwen2_vl: only --hidden-size, --num-layers,
--num-heads and --seed apply; a processor is saved with them).
"""

import argparse
import math
import sys
from pathlib import Path

from safetensors import safe_open

# run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlmega.demo.tiny_model import ARCHITECTURES, make_tiny_model
from rlmega.demo.tiny_vlm import VLM_ARCHITECTURES, make_tiny_vlm


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument(
        "--arch", default="qwen2", choices=sorted(ARCHITECTURES) + list(VLM_ARCHITECTURES)
    )
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--num-kv-heads", type=int, default=1)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 2 * hidden size")
    p.add_argument(
        "--num-experts",
        type=int,
        default=8,
        help="mixture-of-experts archs: routed experts per layer",
    )
    p.add_argument(
        "--top-k", type=int, default=2, help="mixture-of-experts archs: experts per token"
    )
    p.add_argument(
        "--moe-intermediate-size",
        type=int,
        default=None,
        help="mixture-of-experts archs: default hidden size // 2",
    )
    p.add_argument(
        "--max-position-embeddings",
        type=int,
        default=512,
        help="the context engines may be given (RoPE: no trained positions)",
    )
    p.add_argument(
        "--rope-theta",
        type=float,
        default=10000.0,
        help="RoPE base; long contexts want a large one (Qwen2.5: 1e6)",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's own size")
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    p.add_argument(
        "--if-missing",
        action="store_true",
        help="leave an OUT_DIR that holds a model (config.json) "
        "as it is: a config's first-line command makes its model once, then trains",
    )
    return p


def main(argv=None) -> None:
    p = parser()
    args = vars(p.parse_args(argv))
    if args.pop("if_missing") and (Path(args["out_dir"]) / "config.json").exists():
        print(f"{args['out_dir']}: a model is there already; kept (--if-missing)")
        return
    try:
        if args["arch"] in VLM_ARCHITECTURES:
            path = make_tiny_vlm(
                args["out_dir"],
                **{
                    k: args[k]
                    for k in ("arch", "hidden_size", "num_layers", "num_heads", "seed", "overwrite")
                },
            )
        else:
            path = make_tiny_model(args.pop("out_dir"), **args)
    except (ValueError, FileExistsError) as e:
        p.error(str(e).replace("overwrite=True", "--overwrite"))

    # Count from the saved file, so the number is what was written (tied weights counted once).
    with safe_open(path / "model.safetensors", "pt") as f:
        n_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    print(f"{path}  ({n_params:,} parameters)")


if __name__ == "__main__":
    main()

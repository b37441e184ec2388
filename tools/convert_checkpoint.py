"""Convert between a Hugging Face model folder and a Megatron distributed checkpoint.

Usage:
    # HF -> Megatron dist checkpoint (CKPT_ROOT/step_00000000 + CKPT_ROOT/latest), at TP x PP ranks
    torchrun --standalone --nproc-per-node 2 tools/convert_checkpoint.py hf-to-mcore \
        --hf runs/tiny_model --out runs/tiny_ckpt --tp 2
    python tools/convert_checkpoint.py hf-to-mcore --hf runs/tiny_model --out runs/tiny_ckpt   # one rank

    # Megatron dist checkpoint (a root with `latest`, or one step_* folder) -> HF folder
    python tools/convert_checkpoint.py mcore-to-hf --ckpt runs/tiny_ckpt \
        --hf-config-from runs/tiny_model --out runs/tiny_model_back

The world size must be TP x PP (one rank per model shard, no data parallelism). A plain `python`
run is one rank, so only TP1 x PP1; the layouts on either side need not match, since Megatron's
dist checkpoints reshard on load. `--hf-config-from` gives the model's config.json (the shape to
build) and the tokenizer files copied into the output. The checkpoint holds the weights (and RNG
state) only: no optimizer state, so a trainer loads it with model_only=True.

Weights keep their values bit for bit in both directions: Megatron's vocabulary padding (zero
rows up to a multiple of lcm(128, TP)) is added on the way in and cut off on the way out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import warnings
from pathlib import Path

# run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROG = "convert_checkpoint"
_DTYPES = ("float32", "bfloat16")


class UsageError(Exception):
    """A problem with the arguments or inputs, reported as one message (no traceback)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        epilog="Run with -h after a subcommand for its options.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def layout(s):
        s.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
        s.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
        s.add_argument(
            "--vpp",
            type=int,
            default=None,
            help="virtual pipeline chunks per PP rank (default none)",
        )
        s.add_argument(
            "--dtype",
            choices=("auto",) + _DTYPES,
            default="auto",
            help="parameter dtype; auto: bfloat16 if the HF config says so, else float32",
        )

    a = sub.add_parser("hf-to-mcore", help="HF folder -> Megatron dist checkpoint (step 0)")
    a.add_argument(
        "--hf", required=True, help="Hugging Face model folder (config.json + safetensors)"
    )
    a.add_argument("--out", required=True, help="checkpoint root to create (must be new or empty)")
    layout(a)

    b = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF folder")
    b.add_argument(
        "--ckpt", required=True, help="checkpoint root (with `latest`) or one step_* folder"
    )
    b.add_argument(
        "--hf-config-from",
        required=True,
        help="HF folder whose config.json and tokenizer describe the checkpoint's model",
    )
    b.add_argument("--out", required=True, help="HF folder to write")
    b.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    layout(b)
    return p


# ---- checks that need no torch and no process group ---------------------------------------------


def _hf_config(folder: str, flag: str) -> dict:
    path = Path(folder)
    if not path.is_dir():
        raise UsageError(f"{flag} {folder}: no such folder")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise UsageError(f"{flag} {folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        return json.loads(cfg.read_text())
    except ValueError as e:
        raise UsageError(f"{flag} {folder}: config.json is not valid JSON ({e})") from None


def _check_layout(hf: dict, tp: int, pp: int, vpp: int | None) -> None:
    if tp < 1 or pp < 1 or (vpp is not None and vpp < 1):
        raise UsageError(f"--tp, --pp and --vpp must be >= 1 (got tp={tp}, pp={pp}, vpp={vpp})")
    vpp = vpp or 1
    if vpp > 1 and pp == 1:
        raise UsageError(f"--vpp {vpp} needs --pp >= 2")
    heads = hf.get("num_attention_heads", 1)
    kv = hf.get("num_key_value_heads") or heads
    if heads % tp or kv % tp:
        ok = [d for d in range(1, math.gcd(heads, kv) + 1) if math.gcd(heads, kv) % d == 0]
        raise UsageError(
            f"--tp {tp} must divide num_attention_heads={heads} and num_key_value_heads={kv}; "
            f"use one of {ok}"
        )
    layers = hf.get("num_hidden_layers", 1)
    if layers % (pp * vpp):
        raise UsageError(f"num_hidden_layers={layers} is not divisible by PP x VPP = {pp} x {vpp}")


def _check_world(tp: int, pp: int) -> None:
    """World size == TP x PP. A plain `python` run becomes a one-rank world here."""
    if "WORLD_SIZE" not in os.environ:
        if tp * pp != 1:
            raise UsageError(
                f"--tp {tp} --pp {pp} needs {tp * pp} ranks: run it under "
                f"`torchrun --standalone --nproc-per-node {tp * pp} tools/convert_checkpoint.py ...`"
            )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        return
    world = int(os.environ["WORLD_SIZE"])
    if world != tp * pp:
        raise UsageError(
            f"world size {world} != TP x PP = {tp} x {pp}: launch "
            f"`torchrun --nproc-per-node {tp * pp}` (this tool runs no data parallelism)"
        )


def _dtype(choice: str, hf: dict) -> str:
    if choice != "auto":
        return choice
    return "bfloat16" if (hf.get("dtype") or hf.get("torch_dtype")) == "bfloat16" else "float32"


def _checkpoint_dir(ckpt: str) -> Path:
    """The complete step folder that `ckpt` names (a root with `latest`, or a step folder)."""
    path = Path(ckpt)
    if not path.is_dir():
        raise UsageError(f"--ckpt {ckpt}: no such folder")
    if (path / "latest").is_file():
        step = path / (path / "latest").read_text().strip()
        if not step.is_dir():
            raise UsageError(f"--ckpt {ckpt}: `latest` points to {step.name}, which does not exist")
        path = step
    if path.suffix == ".partial":
        raise UsageError(
            f"--ckpt {ckpt}: {path.name} is an unfinished save; pick a complete step_* folder"
        )
    if not (path / "metadata.json").is_file():
        raise UsageError(
            f"--ckpt {ckpt}: not a Megatron dist checkpoint (no `latest` and no metadata.json in {path})"
        )
    return path


def _hf_param_count(folder: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            n += sum(math.prod(sf.get_slice(k).get_shape()) for k in sf.keys())
    return n


# ---- the conversions (collective: every rank runs them) ----------------------------------------


def _manager(hf_folder: str, args, hf: dict):
    import torch.distributed as dist

    from rlmega.config.schema import ModelConfig, OptimizerConfig, ParallelismConfig
    from rlmega.megatron.model_manager import MegatronModelManager

    return MegatronModelManager(
        ModelConfig(path=hf_folder, dtype=_dtype(args.dtype, hf)),
        ParallelismConfig(args.tp, args.pp, args.vpp, dist.get_world_size()),
        OptimizerConfig(),
    )


def _uniform_dtype(mm) -> None:
    """Every parameter in the model's dtype. With bfloat16 the local (non-TE) layer spec still
    makes its RMSNorm weights float32 (Megatron's Float16Module would cast them; the manager
    does not wrap in it), which would turn bf16 norms into fp32 ones on the way through.
    The values are unchanged: they came from bf16 and bf16 -> fp32 -> bf16 is exact."""
    for chunk in mm.model:
        chunk.to(mm.dtype)


def _padding_note(shape) -> str:
    extra = (
        (shape.padded_vocab_size - shape.vocab_size)
        * shape.hidden_size
        * (1 if shape.tie_word_embeddings else 2)
    )
    return f"{extra:,} more in Megatron's padded vocabulary ({shape.vocab_size} -> {shape.padded_vocab_size} rows)"


def hf_to_mcore(args, hf: dict) -> None:
    import torch.distributed as dist

    mm = _manager(args.hf, args, hf)
    # builds this rank's chunks, reads its HF slices
    mm.setup_model_and_optimizer(with_optimizer=False)
    _uniform_dtype(mm)
    final = mm.save_checkpoint(args.out, step=0)
    if dist.get_rank() == 0:
        n = _hf_param_count(Path(args.hf))
        print(
            f"wrote {final} (latest -> {final.name}) at TP{args.tp} PP{args.pp}"
            f"{f' VPP{args.vpp}' if args.vpp else ''}, {mm.model_cfg.dtype}: {n:,} parameters, "
            f"{_padding_note(mm.shape)}"
        )


def mcore_to_hf(args, hf: dict) -> None:
    import torch.distributed as dist

    mm = _manager(args.hf_config_from, args, hf)
    mm.setup_model_and_optimizer(load_weights=False, with_optimizer=False)
    _uniform_dtype(mm)
    step, _ = mm.load_checkpoint(args.ckpt, model_only=True)  # reshards from the saved layout
    out = mm.export_hf(args.out, overwrite=args.overwrite)
    if dist.get_rank() == 0:
        print(
            f"wrote {out} from step {step} of {args.ckpt}: {_hf_param_count(out):,} parameters "
            f"({mm.model_cfg.dtype}), config and tokenizer from {args.hf_config_from}"
        )


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        if args.command == "hf-to-mcore":
            hf = _hf_config(args.hf, "--hf")
            if not any(Path(args.hf).glob("*.safetensors")):
                raise UsageError(f"--hf {args.hf}: no *.safetensors weights in the folder")
            out = Path(args.out)
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise UsageError(
                    f"--out {args.out} exists and is not an empty folder; pick a new checkpoint root"
                )
        else:
            _checkpoint_dir(args.ckpt)
            hf = _hf_config(args.hf_config_from, "--hf-config-from")
            out = Path(args.out)
            if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
                raise UsageError(
                    f"--out {args.out} exists and is not empty; pass --overwrite to replace it"
                )
        _check_layout(hf, args.tp, args.pp, args.vpp)
        _check_world(args.tp, args.pp)

        # Heavy imports only now: the checks above answer in well under a second. Megatron's
        # notes about missing Apex/TE and torch's deprecations say nothing about the conversion.
        warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
        warnings.filterwarnings("ignore", category=FutureWarning)
        from rlmega.megatron.hf_config import UnsupportedModelError, ModelShape
        from rlmega.megatron.runtime import init_megatron, teardown_megatron

        try:
            ModelShape.from_hf(hf)
        except UnsupportedModelError as e:
            raise UsageError(
                f"{args.hf if args.command == 'hf-to-mcore' else args.hf_config_from}: {e}"
            ) from None
    except UsageError as e:
        if rank0:
            print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    init_megatron(args.tp, args.pp, args.vpp, seed=0)
    try:
        (hf_to_mcore if args.command == "hf-to-mcore" else mcore_to_hf)(args, hf)
    finally:
        teardown_megatron()
    return 0


if __name__ == "__main__":
    sys.exit(main())

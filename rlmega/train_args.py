"""`rlmega train`'s arguments, apart from the driver (rlmega/train.py) so that `rlmega train --help` and a
usage error answer at once: this module imports nothing heavy (no torch, Ray, vLLM or Megatron)."""

from __future__ import annotations

import argparse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlmega train",
        description="The RL driver: rlmega train CONFIG [key=value ...] (see rlmega/train.py)",
    )
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.total_steps=10")
    p.add_argument("--resume", action="store_true", help="same as trainer.resume=auto")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """``rlmega train``'s arguments in any order: ``CONFIG key=value --resume key=value`` as well as
    ``CONFIG --resume key=value`` (plain ``parse_args`` stops the positional overrides at the first option and
    then calls the rest "unrecognized arguments"; issue 56)."""
    return parser().parse_intermixed_args(argv)

"""Judge functions for tests, importable by dotted path (Ray actors import them too)."""

from __future__ import annotations

import asyncio
import os
import time


def length_scores(response_text: str, label, **kwargs) -> dict:
    """Named scores: reward = 1 if the response equals the label, and the response's length."""
    return {"reward": float(response_text == str(label)), "length": len(response_text)}


async def async_match(response_text: str, label, delay_s: float = 0.0, **kwargs) -> float:
    """An async judge: 1.0 when the response equals the label, after `delay_s` (hangs on label "hang")."""
    await asyncio.sleep(3600 if label == "hang" else delay_s)
    return float(response_text == str(label))


def slow_match(response_text: str, label, delay_s: float = 0.2, **kwargs) -> float:
    """1.0 when the response equals the label, after a blocking sleep of `delay_s`."""
    time.sleep(delay_s)
    return float(response_text == str(label))


def exit_on_label(response_text: str, label, **kwargs) -> float:
    """Kills its own process on the label "exit" (a reward function that crashes its Ray actor)."""
    if label == "exit":
        os._exit(1)
    return 1.0


def no_reward(response_text: str, label, **kwargs) -> dict:
    """Named scores without the required "reward"."""
    return {"score": 1.0}


def pid_scores(response_text: str, label, delay_s: float = 0.0, **kwargs) -> dict:
    """reward 1, and the process that judged (to see which Ray actor an item went to)."""
    time.sleep(delay_s)
    return {"reward": 1.0, "pid": os.getpid()}

"""The GPU tier: everything under tests/gpu is marked ``gpu`` and skipped without CUDA.

Run on a GPU machine (one GPU is enough: world size 1, NCCL) with
    python -m pytest tests/gpu -q -s
The tests need megatron-core importable there (tools/gpu/README.md: bringing its wheel).
"""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(
        reason="tests/gpu needs a CUDA GPU (torch.cuda.is_available() is False)"
    )
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(no_cuda)

"""What the tests' forkserver imports once (rlmega/testing/multiproc.py's PRELOAD), then freezes.

The server imports these with the collector off and freezes the result (as rlmega/heap.py does for a process's
start): every rank is forked from it, and each collection in a rank walked the whole inherited heap (torch,
transformers, megatron-core: ~400k objects), writing every object's header and so copying its memory page by
page from the server. Frozen, the ranks' collections skip it. The server does nothing but import and fork.
"""
import gc

gc.disable()
import megatron.core  # noqa: E402
import megatron.core.dist_checkpointing  # noqa: E402, F401
import megatron.core.models.gpt  # noqa: E402, F401
import megatron.core.optimizer  # noqa: E402, F401
import megatron.core.pipeline_parallel  # noqa: E402, F401
import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
import transformers  # noqa: E402, F401

gc.freeze()
gc.enable()

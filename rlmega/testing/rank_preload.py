"""What the tests' forkserver runs once: the modules of rlmega/testing/multiproc.py's WARM list imported by name
(as multiprocessing's own preload does), with the collector off, then frozen.

Every rank is forked from this server, and each collection in a rank walked the whole heap it inherited
(torch, transformers, megatron-core: ~750k objects), writing every object's header and so copying its memory
page by page from the server: 0.35-0.38 s a full collection, 0.08-0.10 s frozen. The server does nothing but
import and fork; no rlmega module here uses these libraries (only rlmega/megatron/ imports megatron-core).
"""

import gc
import importlib

from rlmega.testing.multiproc import WARM

gc.disable()
for name in WARM:
    importlib.import_module(name)
gc.freeze()
gc.enable()

"""Let megatron-core's real code paths run on a machine without a GPU.

megatron-core 0.16 assumes CUDA in a few places that have nothing to do with the math
(../shared/CPU.md lists them):

* pipeline schedules and p2p communication allocate with ``device="cuda"`` or
  ``device=torch.cuda.current_device()`` and call ``torch.cuda.synchronize()``;
* the model-parallel RNG tracker saves and restores the CUDA generator's state;
* the optimizers classify parameters by ``param.type() == "torch.cuda.FloatTensor"``.

``enable_cpu_execution()`` answers exactly those, and nothing else:

1. a ``TorchFunctionMode`` maps device requests for CUDA (``"cuda"``, ``"cuda:N"``, an int
   index, ``torch.device("cuda")``, ``Tensor.cuda()``) to the CPU, and answers a bare
   ``Tensor.type()`` with the CUDA type name, so the optimizers accept CPU parameters;
2. ``torch.cuda.current_device/synchronize/empty_cache`` become harmless (index 0, no-ops);
3. Megatron's RNG tracker is replaced by ``CpuRNGStatesTracker``, which keeps its named
   states as CPU generator states (the CPU is the device here).

It only redirects where tensors live and what a type query answers; no arithmetic is touched,
so results are those of the same ops on CPU tensors. It is a no-op when CUDA is available and
can be switched off again (``disable_cpu_execution``) so tests can prove what it is needed for.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.tensor_parallel import mappings as mcore_mappings
from megatron.core.tensor_parallel import random as mcore_random

_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    """True for anything torch would read as a CUDA device: 'cuda', 'cuda:1', 0, device('cuda')."""
    if isinstance(device, bool):  # bool is an int; never a device
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


# Bare Tensor.type() answers for the dtypes Megatron's optimizers accept.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device requests to the CPU and answers type queries as CUDA would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.cuda:
            return args[0]  # the tensor already lives on "the device"
        if func is torch.device and args and _is_cuda(args[0]):
            return _CPU  # torch.device("cuda"), torch.device("cuda", 0)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None and args[0].device.type == "cpu":
                return name
        return func(*args, **kwargs)


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Megatron's named RNG states, kept as CPU generator states.

    ``fork(name)`` swaps the process's CPU generator to the named state for the duration of the
    block (so dropout in tensor-parallel regions differs across TP ranks, as on GPU) and stores
    the advanced state back. Megatron's own ``fork`` warns when the CPU state changes inside the
    block, which is what must happen here, so fork is re-implemented rather than inherited.
    """

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


_CUDA_STUBS = {
    "current_device": lambda: 0,
    "synchronize": lambda device=None: None,
    "empty_cache": lambda: None,
}
_RANDOM_STUBS = {
    "_get_cuda_rng_state": _cpu_get_rng_state,
    "_set_cuda_rng_state": _cpu_set_rng_state,
}

# Megatron collectives that allocate on "the current CUDA device" and also run inside backward
# functions (the MoE token dispatcher's all-gather / reduce-scatter over the TP x EP group). A
# TorchFunctionMode is switched off while its handler runs, and a backward runs entirely inside the
# handler's call of ``Tensor.backward``, so these get the mode entered around them again.
_BACKWARD_COLLECTIVES = ("_gather_along_first_dim", "_reduce_scatter_along_first_dim")
# The same for a backward that allocates itself: the linear layers' under sequence parallelism (its
# reduce-scatter's output buffer, ``device=torch.cuda.current_device()``; tensor_parallel/layers.py).
_BACKWARD_FUNCTIONS = (mcore_layers.LinearWithGradAccumulationAndAsyncCommunication,)


def _under_cpu_mode(fn):
    def wrapper(*args, **kwargs):
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    return wrapper


_state: dict | None = None  # what enable_cpu_execution replaced, for disable_cpu_execution


def moe_without_transformer_engine() -> None:
    """Process-global, idempotent, never undone (called by runtime.init_megatron on every rank, GPU or
    not): megatron-core 0.16's MoE router tests ``te_general_gemm is not None`` (moe_utils.py,
    router_gating_linear, whatever moe_router_dtype) but only defines the name when Transformer Engine
    imports, so without TE every router forward raises NameError. Defining it as None (only where the
    module left it undefined) selects the plain torch matmul path it was written to fall back to."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def mla_without_transformer_engine() -> None:
    """Process-global, idempotent, never undone (runtime.init_megatron, every rank): without Transformer Engine,
    megatron-core 0.16's ``extensions/transformer_engine.py`` still imports (TE stands in as a MagicMock), so
    ``multi_latent_attention`` imports a mock ``TELinear`` with its ``HAVE_TE`` True, and MLA's
    ``isinstance(self.linear_proj, TELinear)`` raises TypeError in every MLA layer's constructor. Setting the
    module's flag to what is true (TE absent) takes the branch it was written for; nothing where TE imports."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention

    if not te_ext.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def cpu_execution_enabled() -> bool:
    return _state is not None


def enable_cpu_execution() -> bool:
    """Switch the CPU layer on if there is no GPU. Returns whether it is on. Idempotent."""
    global _state
    if torch.cuda.is_available():
        return False  # a real GPU: megatron-core runs as written
    if _state is not None:
        return True
    saved = {
        "cuda": {k: getattr(torch.cuda, k) for k in _CUDA_STUBS},
        "random": {k: getattr(mcore_random, k) for k in _RANDOM_STUBS},
        "tracker": (
            mcore_random._CUDA_RNG_STATE_TRACKER,
            mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        ),
        "mappings": {k: getattr(mcore_mappings, k) for k in _BACKWARD_COLLECTIVES},
        "backwards": {f: f.__dict__["backward"] for f in _BACKWARD_FUNCTIONS},
    }
    for k in _BACKWARD_COLLECTIVES:
        setattr(mcore_mappings, k, _under_cpu_mode(saved["mappings"][k]))
    for f, backward in saved["backwards"].items():
        f.backward = staticmethod(_under_cpu_mode(backward.__func__))
    for k, v in _CUDA_STUBS.items():
        setattr(torch.cuda, k, v)
    for k, v in _RANDOM_STUBS.items():
        setattr(mcore_random, k, v)
    # Megatron creates its tracker lazily unless one is marked initialised; install ours first.
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mode = CudaToCpuMode()
    mode.__enter__()  # for the whole process: megatron calls land anywhere, any time
    saved["mode"] = mode
    _state = saved
    return True


def disable_cpu_execution() -> None:
    """Undo enable_cpu_execution (tests use this to show what breaks without it)."""
    global _state
    if _state is None:
        return
    _state["mode"].__exit__(None, None, None)
    for k, v in _state["cuda"].items():
        setattr(torch.cuda, k, v)
    for k, v in _state["random"].items():
        setattr(mcore_random, k, v)
    for k, v in _state["mappings"].items():
        setattr(mcore_mappings, k, v)
    for f, backward in _state["backwards"].items():
        f.backward = backward
    mcore_random._CUDA_RNG_STATE_TRACKER, mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _state[
        "tracker"
    ]
    _state = None

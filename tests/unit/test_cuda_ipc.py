"""CudaIpcTransport's plumbing on a CPU machine (the GPU part has never run: rlmega/sync/cuda_ipc.py).

What can run here: the transport refuses clearly without CUDA; its records travel through the same
bucket files as bytes do, keep name, dtype, shape and size, and the reader rebuilds each with the
record's own function and checks what it got. The real rebuild (torch's rebuild_cuda_tensor over a
cudaIpcMemHandle) needs a GPU; here the record carries torch.full, a function that builds a tensor
from plain arguments as the real one does from a handle.
"""

import os
import shutil

import pytest
import torch

from rlmega.sync.cuda_ipc import IpcTensor, ipc_bucket
from rlmega.sync.transports import CudaIpcTransport
from rlmega.sync import bucket_files


def _record(value: float, shape, dtype=torch.float32) -> IpcTensor:
    # 7 slots: index 6 is the device, as in the real handle
    args = (shape, value, None, None, dtype, None, None)
    return IpcTensor(
        str(dtype).removeprefix("torch."),
        tuple(shape),
        torch.Size(shape).numel() * dtype.itemsize,
        "GPU-none",
        _full,
        args,
    )


def _full(shape, value, _a, _b, dtype, _c, _device):
    return torch.full(shape, value, dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_without_cuda_the_transport_refuses_clearly():
    transport = CudaIpcTransport([])
    with pytest.raises(RuntimeError, match="CudaIpcTransport needs CUDA: this process has no GPU"):
        transport.send([("w", torch.ones(2))], 1)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        ipc_bucket([("w", torch.ones(2))])


def test_records_go_through_the_bucket_files_and_rebuild_with_their_bookkeeping():
    d = bucket_files.open_sync_dir([0, 1], 1 << 20)
    try:
        sent = [
            ("model.layers.0.self_attn.q_proj.weight", _record(1.5, (4, 8))),
            ("model.norm.weight", _record(-2.0, (8,), torch.bfloat16)),
        ]
        assert bucket_files.write_bucket(d, 0, sent, [0, 1]) == 4 * 8 * 4 + 8 * 2
        assert sorted(os.listdir(os.path.join(d, "0"))) == ["00000000.ipc"]
        bucket_files.end(d)
        for rank in (0, 1):
            got = list(bucket_files.read_stream(d, rank, idle_timeout_s=5))
            assert [n for n, _ in got] == [n for n, _ in sent]
            assert (
                got[0][1].dtype == torch.float32
                and got[0][1].shape == (4, 8)
                and bool((got[0][1] == 1.5).all())
            )
            assert got[1][1].dtype == torch.bfloat16 and got[1][1].shape == (8,)
        # a handle that rebuilds as something else than was sent is refused, naming both
        bad = _record(0.0, (2, 2))
        bad.shape = (4,)
        with pytest.raises(
            ValueError, match=r"rebuilt as torch.float32 \(2, 2\), sent as float32 \(4,\)"
        ):
            bad.open()
    finally:
        shutil.rmtree(d, ignore_errors=True)

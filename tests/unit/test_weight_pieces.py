"""rlmega/sync/pieces.py: the engine side of a sync without a gather (each TP rank's block of a tensor).

The blocks' layout per Megatron parameter is tests/unit/test_hf_mapping.py; here, placing them: a
piece that does not tile its tensor is refused naming it, pieces cross the object store's pickling as
pieces, and a slot gets the tensor's bytes written block by block, as if it had come whole."""

import pickle

import pytest
import torch

from rlmega.sync.pieces import Assembled, Assembler, Piece
from rlmega.sync.transports import _RawBucket
from rlmega.sync import bucket_files


def _pieces(full: torch.Tensor, dim: int, cuts: list[int]) -> list[Piece]:
    edges = [0, *cuts, full.shape[dim]]
    return [
        Piece(full.narrow(dim, a, b - a).contiguous(), tuple(full.shape), dim, a, len(edges) - 1)
        for a, b in zip(edges, edges[1:])
    ]


@pytest.mark.parametrize("dim", [0, 1])
def test_pieces_complete_in_any_order_into_the_whole_tensor(dim):
    full = torch.randn(6, 10)
    parts = _pieces(full, dim, [2, 5])
    a = Assembler()
    # a whole tensor passes straight on
    assert a.add([("w", parts[2]), ("b", torch.ones(3))], 1)[0][0] == "b"
    assert a.pending() == ["w"] and a.add([("w", parts[0])], 1) == []
    ((name, done),) = a.add([("w", parts[1])], 1)
    assert name == "w" and isinstance(done, Assembled) and a.pending() == []
    assert done.shape == full.shape and done.dtype == full.dtype and done.nbytes == full.nbytes
    assert torch.equal(done.tensor(), full)


def test_pieces_of_another_weights_version_never_complete_a_tensor():
    """A late block of a failed sync (version 1) must not mix into the next sync's tensor (version 2)."""
    old, new = torch.zeros(4, 2), torch.ones(4, 2)
    a = Assembler()
    assert a.add([("w", _pieces(old, 0, [2])[1])], 1) == []  # version 1's rank 1 block, late
    assert a.add([("w", _pieces(new, 0, [2])[0])], 2) == [] and a.pending(2) == ["w"] == a.pending(
        1
    )
    assert a.held_bytes == old.nbytes // 2 + new.nbytes // 2
    a.drop_older(2)  # version 2's sync ended: version 1's leftovers go
    assert a.pending(1) == [] and a.held_bytes == new.nbytes // 2
    ((_, done),) = a.add([("w", _pieces(new, 0, [2])[1])], 2)
    assert torch.equal(done.tensor(), new) and a.held_bytes == 0 and a.pending() == []


def test_the_rank_holding_nothing_back_is_never_the_one_told_to_wait():
    """Back-pressure on held pieces (WeightStream._wait_for_pieces) waits only for senders with pieces
    held: at TP 3, ranks 0 and 1 ahead by two tensors, rank 2 behind holds nothing and goes on."""
    tensors = [torch.randn(6, 2) for _ in range(3)]
    parts = [_pieces(t, 0, [2, 4]) for t in tensors]  # parts[tensor][rank]
    a = Assembler()
    for rank in (0, 1):
        assert a.add([(f"t{i}", parts[i][rank]) for i in range(2)], 1, sender=rank) == []
    assert a.holds(0) == a.holds(1) == 2 * parts[0][0].nbytes and a.holds(2) == 0
    # the behind rank completes the first tensor
    ((_, done),) = a.add([("t0", parts[0][2])], 1, sender=2)
    assert (
        torch.equal(done.tensor(), tensors[0])
        and a.holds(2) == 0
        and a.holds(0) == parts[0][0].nbytes
    )
    assert a.add([("t1", parts[1][2]), ("t2", parts[2][2])], 1, sender=2)[0][0] == "t1"
    # now rank 2 is ahead on t2
    assert a.holds(2) == parts[2][2].nbytes and a.held_bytes == parts[2][2].nbytes
    a.clear()
    assert a.held_bytes == 0 and a.holds(2) == 0


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            lambda p: Piece(p.tensor, p.full_shape, p.dim, p.start + 1, p.of),
            "gap or overlap|does not fit",
        ),
        (lambda p: Piece(p.tensor[:, :3], p.full_shape, p.dim, p.start, p.of), "does not fit"),
        (lambda p: Piece(p.tensor.double(), p.full_shape, p.dim, p.start, p.of), "disagree"),
        (
            lambda p: Piece(p.tensor, p.full_shape, p.dim, 0, p.of),
            "gap or overlap",
        ),  # both blocks at 0: fits, overlaps
    ],
)
def test_pieces_that_do_not_tile_the_tensor_are_refused_naming_it(bad, match):
    parts = _pieces(torch.randn(6, 4), 0, [3])
    with pytest.raises(ValueError, match=match) as e:
        Assembler().add(
            [
                ("model.layers.0.mlp.gate_proj.weight", parts[0]),
                ("model.layers.0.mlp.gate_proj.weight", bad(parts[1])),
            ],
            1,
        )
    assert "gate_proj" in str(e.value)


def test_pieces_cross_the_object_stores_pickling_as_pieces():
    full = torch.randn(4, 6)
    bucket = [("n", torch.arange(3.0)), *(("w", p) for p in _pieces(full, 1, [4]))]
    back = pickle.loads(pickle.dumps(_RawBucket(bucket), protocol=5))
    assert torch.equal(back[0][1], bucket[0][1]) and not isinstance(back[0][1], Piece)
    for (_, sent), (_, got) in zip(bucket[1:], back[1:]):
        assert isinstance(got, Piece) and torch.equal(got.tensor, sent.tensor)
        assert (got.full_shape, got.dim, got.start, got.of) == (
            sent.full_shape,
            sent.dim,
            sent.start,
            sent.of,
        )


def test_a_bucket_with_an_assembled_tensor_reads_back_whole(tmp_path):
    """The file fallback and a slot hold the same bytes the whole tensor would have given."""
    full, norm = torch.randn(5, 8), torch.randn(8)
    ((_, whole),) = Assembler().add([("w", p) for p in _pieces(full, 0, [1, 3])], 1)
    head, start, parts, size = bucket_files.layout([("n", norm), ("w", whole)])
    slot = torch.zeros(size, dtype=torch.uint8)
    slot[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    for t, off in parts:  # as SlotPool.write does
        if isinstance(t, Assembled):
            t.write_into(slot[start + off : start + off + t.nbytes])
        else:
            slot[start + off : start + off + t.nbytes] = t.reshape(-1).view(torch.uint8)
    got = dict(bucket_files.views(bytes(slot.numpy()), slot))
    assert torch.equal(got["w"], full) and torch.equal(got["n"], norm)
    directory = bucket_files.open_sync_dir([0], size)
    try:
        bucket_files.write_bucket(directory, 0, [("n", norm), ("w", whole)], [0])
        got = dict(bucket_files.read_bucket(f"{directory}/0/00000000.bin"))
        assert torch.equal(got["w"], full) and torch.equal(got["n"], norm)
    finally:
        import shutil

        shutil.rmtree(directory)

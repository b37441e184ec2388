"""MegatronModelManager.make_data_iterator_list: the one place that builds megatron-core's schedule iterator."""

import torch

from rlmega.megatron.model_manager import make_data_iterator_list


def _mb(rows: int, length: int) -> dict:
    return {"tokens": torch.zeros(rows, length, dtype=torch.long)}


def test_one_iterator_without_virtual_stages_one_per_chunk_with():
    mbs = [_mb(1, 5), _mb(2, 9), _mb(1, 3)]
    single = make_data_iterator_list(iter(mbs))  # a generator is fine: it is read once, then shared
    assert list(single) == mbs
    chunks = make_data_iterator_list(iter(mbs), vpp_size=2)
    assert isinstance(chunks, list) and len(chunks) == 2
    # each chunk pulls all
    assert [next(chunks[0]), next(chunks[1]), next(chunks[0])] == [mbs[0], mbs[0], mbs[1]]


def test_padding_records_the_longest_row_for_the_schedule():
    mbs = [_mb(1, 5), _mb(2, 9), _mb(1, 3)]
    make_data_iterator_list(mbs, padding=True)
    assert [mb["max_batch_seqlen"] for mb in mbs] == [9, 9, 9]
    assert all(mb["tokens"].shape[1] in (5, 9, 3) for mb in mbs)  # nothing is padded in place
    rows = [torch.zeros(2, 4)]  # tensors (lm_step's rows) pass through untouched
    assert next(make_data_iterator_list(rows, padding=True)) is rows[0]

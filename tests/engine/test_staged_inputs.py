"""The decode graphs' staged inputs (CPU: unpinned twins, no event): a step's live rows, then
padding rows that read and write only the scratch page, on every write, whatever the earlier
steps left in the buffers."""
import torch

from moeferry.engine.cuda_graph import StagedInputs

ROWS, PAGES, SCRATCH_PAGE, PAGE_SIZE = 4, 3, 9, 16


def test_live_rows_then_padding_on_every_write():
    x = StagedInputs(ROWS, PAGES, torch.device("cpu"), SCRATCH_PAGE, PAGE_SIZE)
    device_views = (x.input_ids, x.positions, x.out_slots, x.page_table, x.seq_lens)
    pointers = [t.data_ptr() for t in device_views]

    x.write([5, 6, 7], [10, 40, 3], [33, 72, 50], [11, 41, 4], [[2], [4, 1, 3], [3]], ROWS)
    assert x.input_ids.tolist() == [5, 6, 7, 0]
    assert x.positions.tolist() == [10, 40, 3, 0]
    assert x.out_slots.tolist() == [33, 72, 50, SCRATCH_PAGE * PAGE_SIZE]
    assert x.seq_lens.tolist() == [11, 41, 4, 1]
    assert x.page_table.tolist() == [[2, 9, 9], [4, 1, 3], [3, 9, 9], [9, 9, 9]]

    # Fewer requests, in a smaller graph: the rows of the earlier, larger step become padding.
    x.write([8], [17], [49], [18], [[3, 7]], 2)
    assert x.input_ids.tolist()[:2] == [8, 0]
    assert x.out_slots.tolist()[:2] == [49, SCRATCH_PAGE * PAGE_SIZE]
    assert x.seq_lens.tolist()[:2] == [18, 1]
    assert x.page_table.tolist()[:2] == [[3, 7, 9], [9, 9, 9]]
    assert [t.data_ptr() for t in device_views] == pointers  # what a captured graph reads never moves

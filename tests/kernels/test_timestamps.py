"""Device timestamps (kernels/timestamps): each stamp lands in its step's row at its point,
later stamps never earlier, `advance` moves to the next row and wraps; on the GPU the Triton
stamp does the same inside a captured graph and brackets the work between two stamps."""
import pytest
import torch

from moeferry.kernels import timestamps
from moeferry.kernels.timestamps import reference


def test_stamps_go_to_their_row_and_point_and_advance_wraps():
    times, counter = torch.zeros(3, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for step in range(5):
        reference.stamp(times, counter, 0, False)
        reference.stamp(times, counter, 1, True)
        row = step % 3
        assert times[row, 1] >= times[row, 0] > 0 and int(counter) == step + 1
    assert times[1, 0] > times[0, 1]  # step 4 overwrote row 1 after step 3 wrote row 0
    timestamps.stamp(times, counter, 0)  # CPU: the public function takes the reference
    assert times[2, 0] > times[1, 1] and int(counter) == 5


@pytest.mark.gpu
def test_triton_stamps_bracket_work_inside_a_graph():
    times = torch.zeros(4, 3, dtype=torch.int64, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")

    def step():
        timestamps.stamp(times, counter, 0)
        torch.cuda._sleep(2_000_000)  # about a millisecond of spinning
        timestamps.stamp(times, counter, 1)
        timestamps.stamp(times, counter, 2, advance=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    counter.zero_()
    times.zero_()
    for _ in range(6):
        graph.replay()
    torch.cuda.synchronize()
    assert int(counter) == 6
    t = times.cpu()
    assert (t[:, 1] - t[:, 0] > 100_000).all() and (t[:, 2] >= t[:, 1]).all(), t  # the sleep, in ns
    assert t[1, 0] > t[0, 2] and t[0, 0] > t[3, 2]  # steps 4 and 5 overwrote rows 0 and 1 after step 3

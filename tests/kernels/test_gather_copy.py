"""Miss copy: Triton gather (interpreted on CPU) and its reference write exactly the planned
slot rows, byte for byte, for any dtype; every other row keeps its poison. The banks' list
mixes word sizes so that some banks launch alone and others share a launch in pairs."""
import pytest
import torch

from moeferry.kernels.gather_copy import reference

BANK_SHAPES = [  # (row shape, dtype): words of 8, 4, 2 and 1 byte, masked and even chunks
    ((6, 16), torch.bfloat16),
    ((3, 5), torch.float32),
    ((7,), torch.uint8),
    ((2, 3), torch.int16),
    ((9000,), torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else torch.uint8),
    ((2, 16384), torch.uint8),
    ((3, 12000), torch.bfloat16),  # with the next: a w13/w2-like pair in one launch, rows of
    ((5, 7000), torch.bfloat16),   # two 64 KiB chunks each, the last chunk masked
]


def copy_fns():
    from moeferry.kernels.gather_copy import triton as triton_gather
    return {"reference": reference.gather_copy, "triton": triton_gather.gather_copy}


def random_bank(rows, row_shape, dtype, generator, device="cpu"):
    raw = torch.randint(0, 256, (rows, *row_shape, torch.empty((), dtype=dtype).element_size()),
                        dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(rows, *row_shape).to(device)


def pinned_if_gpu(bank, device):
    return bank.pin_memory() if torch.device(device).type == "cuda" else bank


def byte_rows(bank):
    return bank.view(torch.uint8).reshape(bank.shape[0], -1)


def make_plan(num_experts, num_slots, plan_size, count, generator, device="cpu"):
    src = torch.randperm(num_experts, generator=generator)[:plan_size].int()
    dst = torch.randperm(num_slots, generator=generator)[:plan_size].int()
    return src.to(device), dst.to(device), torch.tensor([count], dtype=torch.int32, device=device)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("count", [0, 3, 8])
def test_exactly_the_planned_slots_change(impl, count, device):
    generator = torch.Generator().manual_seed(count)
    num_experts, num_slots, plan_size = 10, 14, 8
    host = [pinned_if_gpu(random_bank(num_experts, shape, dtype, generator), device)
            for shape, dtype in BANK_SHAPES]
    slots = [random_bank(num_slots, shape, dtype, generator, device) for shape, dtype in BANK_SHAPES]
    poison = [byte_rows(bank).cpu().clone() for bank in slots]
    plan_src, plan_dst, plan_count = make_plan(num_experts, num_slots, plan_size, count, generator, device)
    copy_fns()[impl](host, slots, plan_src, plan_dst, plan_count)
    planned = {int(d): int(s) for s, d in zip(plan_src[:count], plan_dst[:count])}
    for bank, src_bank, before in zip(slots, host, poison):
        after = byte_rows(bank).cpu()
        for slot in range(num_slots):
            expected = byte_rows(src_bank)[planned[slot]] if slot in planned else before[slot]
            assert torch.equal(after[slot], expected), f"{bank.dtype} slot {slot}"


def test_mismatched_banks_are_refused():
    host = [torch.zeros(4, 3)]
    for fn in copy_fns().values():
        with pytest.raises(ValueError):
            fn(host, [torch.zeros(5, 4)], *make_plan(4, 5, 2, 1, torch.Generator()))
        with pytest.raises(ValueError):
            fn(host, [torch.zeros(5, 3, dtype=torch.float16)],
               *make_plan(4, 5, 2, 1, torch.Generator()))


@pytest.mark.gpu
@pytest.mark.parametrize("row_shape,dtype", [((1536, 2048), torch.bfloat16),
                                             ((2048, 768), torch.bfloat16),
                                             ((1536, 2048), torch.float8_e4m3fn),  # block-FP8 experts
                                             ((2048, 768), torch.float8_e4m3fn),   # and their scales:
                                             ((12, 16), torch.float32), ((16, 6), torch.float32),
                                             ((4, 4), torch.float32), ((1000, 3), torch.uint8)])
def test_gather_reads_pinned_host_memory_on_gpu(row_shape, dtype):
    from moeferry.kernels.gather_copy import triton as triton_gather
    generator = torch.Generator().manual_seed(0)
    num_experts, num_slots, plan_size, count = 12, 16, 10, 7
    host = [random_bank(num_experts, row_shape, dtype, generator).pin_memory()]
    slots = [random_bank(num_slots, row_shape, dtype, generator, "cuda")]
    before = byte_rows(slots[0]).clone()
    plan = make_plan(num_experts, num_slots, plan_size, count, generator, "cuda")
    triton_gather.gather_copy(host, slots, *plan)
    expected = before.clone()
    expected[plan[1][:count].long()] = byte_rows(host[0])[plan[0][:count].cpu().long()].cuda()
    torch.cuda.synchronize()
    assert torch.equal(byte_rows(slots[0]), expected)


@pytest.mark.parametrize("max_programs", [1, 3])
def test_a_capped_grid_copies_every_planned_row(max_programs):
    """GatherTuning.max_programs: fewer programs loop over more work items, the same bytes land."""
    from moeferry.kernels.gather_copy import GatherTuning
    from moeferry.kernels.gather_copy import triton as triton_gather

    generator = torch.Generator().manual_seed(max_programs)
    shapes = BANK_SHAPES[-2:]
    host = [random_bank(9, shape, dtype, generator) for shape, dtype in shapes]
    slots = [random_bank(12, shape, dtype, generator) for shape, dtype in shapes]
    want = [bank.clone() for bank in slots]
    plan_src, plan_dst, plan_count = make_plan(9, 12, 6, 5, generator)
    reference.gather_copy(host, want, plan_src, plan_dst, plan_count)
    triton_gather.gather_copy(host, slots, plan_src, plan_dst, plan_count, GatherTuning(max_programs=max_programs))
    assert all(torch.equal(byte_rows(a), byte_rows(b)) for a, b in zip(slots, want))

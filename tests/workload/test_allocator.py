"""The caching allocator's replay against PyTorch's own: a lent H100's allocator trace, and hand-worked
sequences from CUDACachingAllocator.cpp's rules."""

from pathlib import Path

import torch

from fxworkload.workload.allocator import CachingAllocator, rounded_bytes, segment_bytes

MIB = 1 << 20


def test_replaying_a_real_step_reserves_what_torch_reserved(alloc_trace):
    """Every allocation and free torch's allocator recorded over GPT-2's model build and four steps, replayed:
    reserved after each step and the peaks equal, to the byte, what torch.cuda reported on the GPU."""
    trace = alloc_trace
    starts = trace["step_starts"] + [len(trace["events"])]
    allocator, live = CachingAllocator(), {}
    for step, (begin, end) in enumerate(zip([0] + starts[:-1], starts)):
        if step:
            allocator.reset_peaks()
        for action, address, nbytes in trace["events"][begin:end]:
            if action == "alloc":
                live[address] = allocator.malloc(nbytes)
            elif action == "free_completed":
                allocator.free(live.pop(address))
        measured = trace["after"][step]
        assert allocator.reserved_bytes == measured["reserved_bytes"]
        if step:
            assert allocator.peak_reserved_bytes == measured["max_reserved_bytes"]
            assert allocator.peak_allocated_bytes == measured["max_allocated_bytes"]
    # the second step needed a segment the first did not: reserved grew by 1,572 MiB, allocated did not
    assert trace["after"][2]["reserved_bytes"] - trace["after"][1]["reserved_bytes"] == 1572 * MIB


def test_request_sizes_and_segments_follow_the_allocator_constants():
    assert rounded_bytes(1) == 512 and rounded_bytes(513) == 1024  # kMinBlockSize
    assert segment_bytes(MIB) == 2 * MIB  # kSmallSize and below: a 2 MiB kSmallBuffer
    assert segment_bytes(MIB + 512) == 20 * MIB  # under kMinLargeAlloc (10 MiB): a 20 MiB kLargeBuffer
    assert segment_bytes(10 * MIB) == 10 * MIB  # from 10 MiB: rounded up to 2 MiB (kRoundLarge)
    assert segment_bytes(10 * MIB + 1) == 12 * MIB


def test_small_requests_share_a_segment_and_large_ones_split_a_20_mib_one():
    allocator = CachingAllocator()
    for _ in range(3):
        allocator.malloc(600 * 1024)  # 3 x 600 KiB in one 2 MiB segment
    assert allocator.reserved_bytes == 2 * MIB
    allocator.malloc(600 * 1024)  # 200 KiB left there: a second small segment
    assert allocator.reserved_bytes == 4 * MIB
    allocator.malloc(3 * MIB)  # a 20 MiB segment, split: 17 MiB left cached
    allocator.malloc(16 * MIB)  # 16 MiB fits those 17 MiB (remaining 1 MiB: not split, per should_split)
    assert allocator.reserved_bytes == 24 * MIB
    assert allocator.allocated_bytes == 4 * 600 * 1024 + 3 * MIB + 17 * MIB  # the unsplit block counts whole


def test_freed_neighbours_merge_and_best_fit_picks_the_smallest_block():
    allocator = CachingAllocator()
    a = allocator.malloc(12 * MIB)
    b = allocator.malloc(12 * MIB)
    allocator.malloc(12 * MIB)  # three exact 12 MiB segments
    allocator.free(a)
    allocator.free(b)  # two segments: never merged across segments, so 20 MiB needs a new one
    allocator.malloc(20 * MIB)
    assert allocator.reserved_bytes == 56 * MIB
    big = allocator.malloc(40 * MIB)
    allocator.free(big)
    allocator.malloc(8 * MIB)  # best fit: a free 12 MiB segment, not the 40 MiB one
    allocator.malloc(30 * MIB)  # the 40 MiB segment, split (10 MiB left)
    first, second = allocator.malloc(4 * MIB), allocator.malloc(4 * MIB)  # the 12 MiB's 4 MiB rest; the 10 MiB rest, split
    allocator.free(first)
    assert allocator.reserved_bytes == 96 * MIB
    allocator.free(second)
    allocator.malloc(10 * MIB)  # second and its 6 MiB rest merged back into 10 MiB: no new segment
    assert allocator.reserved_bytes == 96 * MIB


def test_a_full_device_releases_its_free_segments_before_growing():
    allocator = CachingAllocator(capacity_bytes=40 * MIB)
    allocator.free(allocator.malloc(30 * MIB))  # cached, wholly free
    allocator.malloc(32 * MIB)  # 30 MiB does not hold it; 62 MiB would pass the device: released first
    assert allocator.reserved_bytes == 32 * MIB and allocator.releases == 1


def test_gpt2s_step_reserves_about_what_a_lent_h100_reserved(tmp_path):
    """GPT-2 (models/gpt2), batch 8, seq 1024, bf16, eager, traced as an H100 dispatches it: the replay's
    steady-state peaks beside bench/data/lent-gpus/h100/graphs/reserved.json (bench/gpu_graphs.py, torch
    2.11 on an H100 80GB HBM3): max_memory_allocated 9,680,685,568 and max_memory_reserved 12,207,521,792
    bytes over a fifth step. Allocated is the graph's tensors, the kernels' scratch and cuBLAS's two handles'
    workspaces (workload/scratch.py); reserved follows from them: the workspace the backward's first GEMM takes
    splits a cached segment the loss's fp32 logits needed, and the second step cudaMallocs one more."""
    from fxworkload.capture import models
    from fxworkload.capture.trace import capture_training_step
    from fxworkload.cost import devices
    from fxworkload.cost.flops import register_transformers_ops
    from fxworkload.pipeline import trace_target
    from fxworkload.workload.memory import activation_memory

    register_transformers_ops()
    spec = models.resolve(str(Path(__file__).resolve().parents[2] / "models" / "gpt2"))
    module = models.build_meta_model(spec, torch.bfloat16)
    capture = capture_training_step(module, 8, 1024, gpu=trace_target("auto", devices.load("h100-sxm")))
    memory = activation_memory(capture)
    assert abs(memory.allocated_peak_bytes / 9_680_685_568 - 1) < 0.01
    assert abs(memory.reserved_peak_bytes / 12_207_521_792 - 1) < 0.01  # -13.9 % before the workspaces
    assert memory.reserved_peak_bytes > memory.allocated_peak_bytes * 1.2  # the allocator's slack: 1.26 measured

"""ZeRO-3 / FSDP as they run: a pass of one micro-batch on two streams of a rank, compute and communication.

Parameters are sharded over the data-parallel group and gathered per FSDP unit (a decoder layer, as
FSDP's transformer wrap policy and DeepSpeed's ZeRO-3 fetch them; the embedding and the head each
one unit) just before the unit runs, and freed after it (``reshard_after_forward``, FSDP's default
and ZeRO-3's), so backward gathers them again; FSDP2's ``reshard_after_forward=False`` keeps them
from forward to backward. What the communication stream runs, in the order it is issued:

- forward: unit 1's gather, then each unit's successor's gather as that unit starts computing
  (prefetch of one: FSDP's ``forward_prefetch`` / ``limit_all_gathers``);
- backward, units in reverse: the same prefetch of the next unit's gather when a unit starts, and
  the unit's gradient reduce-scatter when its backward ends (``BACKWARD_PRE`` prefetch).

FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``) also runs two copies per unit
on the compute stream: after each gather, ``foreach_all_gather_copy_out`` splits the gathered buffer
into the unsharded parameters (``split_with_sizes_copy``: the unit's parameter bytes read and
written); before each reduce-scatter, ``foreach_reduce_scatter_copy_in`` packs the unsharded
gradients into the reduce-scatter input in the reduce dtype (``chunk_cat``: the gradients read in the
parameters' dtype, written in the reduce dtype). Its copy-in of the local shards before a gather runs
on a stream of its own and moves 1/dp of that: not counted.

A unit computes once its parameters are in and the previous unit is done, so a gather longer than
the unit before it, and the first gather of every pass, are exposed. While a collective runs beside
it, compute is slowed by the share of the GPU's SMs that NCCL's kernels hold (one CTA per channel,
``NCCL_CHANNELS`` of ``sm_count``). The reduce-scatter that ends a pass spills into what follows.

FSDP2's hooks run on the host around each unit (``HOOK_US``, measured by ``bench/fsdp2_host.py``): where the
host's issue of a unit's ops and its hooks take longer than the unit on the GPU, the compute stream waits the
difference (``Group.host_wait_ns``), which the step reports with the rest of the GPU's wait on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

# NCCL runs one CTA per channel on its own SM; on NVLink-connected H100s it reports 16 collective
# channels ("16 coll channels" in NCCL_DEBUG=INFO logs of DGX H100 all-gathers and reduce-scatters).
# Assumed for every GPU: compute beside a collective keeps (sm_count - 16) / sm_count of its SMs.
NCCL_CHANNELS = 16

# FSDP2's hooks on the host (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py), per unit and pass: before
# the unit's forward pre_forward (unshard: the shards' copy-in, the all-gather's issue, the copy-out, a setattr per
# parameter; the post-backward hook's registration), after it post_forward (the sharded parameters swapped back);
# in backward pre_backward (the same unshard) and post_backward (the gradients' copy-in, the reduce-scatter's
# issue, a sharded gradient DTensor per parameter). Microseconds, (fixed, per parameter tensor), forward and
# backward: bench/fsdp2_host.py (torch 2.13 on torch's fake process group, this project's 2-core AMD EPYC VM, idle
# but for the bench, 2026-11-27), taken to run at the same pace on a GPU's host. A Llama decoder layer's 9
# parameters: 0.51 ms around its forward, 0.75 ms around its backward.
HOOK_US = {False: (392.0, 13.5), True: (626.1, 14.2)}  # backward?: (fixed, per parameter)


@dataclass(frozen=True)
class Group:
    """One FSDP unit of a pass: its compute (with its blocking tensor-parallel collectives), the gather
    of its parameters and the reduce-scatter of its gradients (0 in forward)."""
    compute_ns: float
    gather_ns: float
    reduce_scatter_ns: float = 0.0
    copy_ns: float = 0.0  # FSDP2's copy-out after the gather and copy-in before the reduce-scatter (compute stream)
    host_wait_ns: float = 0.0  # the compute stream idle while the host runs FSDP2's hooks (fsdp2_host_wait_ns)


@dataclass(frozen=True)
class PassTimeline:
    duration_ns: float  # the compute stream's end
    exposed_gather_ns: float  # compute waiting for parameters
    trailing_ns: float  # communication still running when the compute ends (the last reduce-scatter)
    slowdown_ns: float  # compute lost to the SMs NCCL's kernels held
    copy_ns: float = 0.0  # FSDP2's copy kernels on the compute stream
    host_wait_ns: float = 0.0  # the compute stream idle while the host runs FSDP2's hooks


def hooks_ns(backward: bool, parameters: int) -> float:
    """FSDP2's hooks' host time around one unit's forward or backward (HOOK_US)."""
    fixed_us, per_parameter_us = HOOK_US[backward]
    return 1e3 * (fixed_us + per_parameter_us * parameters)


def fsdp2_host_wait_ns(gpu_ns: float, issue_ns: float, backward: bool, parameters: int) -> float:
    """What one unit's pass waits on the host beyond what its ops' issue already costs it: the host issues the
    unit's ops (``issue_ns``, the sum of their dispatch) and runs FSDP2's hooks around them; where that takes
    longer than the pass's ``gpu_ns`` (its kernels, or their issue where already the longer: Unit.pass_ns), the
    GPU waits the difference. Where the GPU is the slower, the hooks run while it works: nothing."""
    return max(0.0, issue_ns + hooks_ns(backward, parameters) - gpu_ns)


def compute_share_lost(sm_count: int | None) -> float:
    return NCCL_CHANNELS / sm_count if sm_count else 0.0


def simulate_pass(groups: list[Group], share_lost: float) -> PassTimeline:
    """``groups`` in the order the pass runs them (forward order, or reversed for backward)."""
    stream: list[tuple[float, float]] = []  # (start, end) of each collective, in issue order
    free = 0.0

    def issue(at: float, duration: float) -> float:
        nonlocal free
        if duration <= 0:
            return at
        start = max(free, at)
        free = start + duration
        stream.append((start, free))
        return free

    ready = [0.0] * len(groups)  # when each unit's parameters are in
    if groups:
        ready[0] = issue(0.0, groups[0].gather_ns)
    end = exposed = slowdown = 0.0
    first = 0  # the first collective still running: one stream, so they end in issue order, and start only grows
    for i, group in enumerate(groups):
        start = max(end, ready[i])
        exposed += start - end
        if i + 1 < len(groups):
            ready[i + 1] = issue(start, groups[i + 1].gather_ns)
        while first < len(stream) and stream[first][1] <= start:
            first += 1
        work = group.compute_ns + group.copy_ns + group.host_wait_ns
        busy = sum(max(0.0, min(e, start + work) - max(s, start)) for s, e in stream[first:])
        lost = share_lost * busy
        end = start + work + lost
        slowdown += lost
        issue(end, group.reduce_scatter_ns)
    return PassTimeline(duration_ns=end, exposed_gather_ns=exposed, trailing_ns=max(0.0, free - end),
                        slowdown_ns=slowdown, copy_ns=sum(g.copy_ns for g in groups),
                        host_wait_ns=sum(g.host_wait_ns for g in groups))

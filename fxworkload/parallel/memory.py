"""Memory of one rank at its peak: model states as ZeRO and TP/PP/EP divide them, and activations.

Model states (Rajbhandari et al. 2020, "ZeRO"): Adam keeps two moments per parameter; under mixed
precision (a bf16/fp16 step) also an fp32 master copy, so the optimizer holds 12 bytes per
parameter, 8 in an fp32 step. Parameters take the step dtype's size, gradients the gradient
dtype's. ZeRO 1 divides the optimizer states over the data-parallel group, 2 the gradients too,
3 the parameters too; expert parameters are divided over their own data-parallel group (dp / ep).

Activations: a micro-batch holds what its forward saved for backward (read off the joint graph,
workload/memory.py) until its backward runs. Under 1F1B a stage holds min(pp - stage,
micro-batches) of them at once (the first stage pp); under the interleaved schedule the first
stage holds pp(1 + (pp - 1)/(pp·vpp)) micro-batches' worth (Korthikanti et al. 2022). The transient is what the step adds on top
of the saved activations at its peak (the loss's logits and the backward's gradients of
activations), as the captured whole model's step shows it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..dtypes import DTYPES
from ..memo import Memo
from .layout import Parallel, expert_replicas
from .units import is_expert
from ..workload.table import Workload

ADAM_BYTES_PER_PARAMETER = {"mixed": 12, "fp32": 8}  # fp32 master copy + two moments; two moments
# The optimizer offloaded to the host (cluster/offload.py): per offloaded parameter the GPU frees Adam's two fp32
# moments (its fp32 main parameter stays, the host's result copied back into it); the host holds an fp32 copy
# and both moments
MOMENTS_BYTES_PER_PARAMETER = 8
HOST_COPY_BYTES_PER_PARAMETER = 12


@dataclass(frozen=True)
class RankMemory:
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # saved activations of the micro-batches in flight
    transient_bytes: int  # the step's peak above its saved activations
    step_peak_bytes: int  # one micro-batch's forward and backward above the resident states (grads freed)
    total_peak_bytes: int
    micro_batches_in_flight: int
    capacity_bytes: int  # the device's memory; 0 where the profile has none (CPU)
    # ZeRO 3 --keep-gathered: every unit's gathered parameters, forward to backward (--reshard-after-forward N: 1/N)
    gathered_parameters_bytes: int = 0
    # ZeRO 3 --accumulate-unsharded over micro-batches: every unit's unsharded gradients summed from the first
    # micro-batch's backward to the last's reduce-scatter
    accumulated_gradients_bytes: int = 0
    fp8_weights_bytes: int = 0  # --fp8: the FP8 copies of the rank's linear weights and their transposes (2 bytes each)
    host_bytes: int = 0  # --optimizer-offload: the offloaded share's host copy, moments and pinned gradients;
    # --activation-offload-layers: the offloaded layers' saved activations, pinned
    host_capacity_bytes: int = 0  # the GPU's share of the host's memory; 0 where the profile has none
    # total_peak_bytes and the segments PyTorch's caching allocator holds beyond it over the step
    # (Workload.reserved_slack_bytes): what torch.cuda.max_memory_reserved reports, as torchtitan logs it
    reserved_peak_bytes: int = 0

    @property
    def fits(self) -> bool | None:
        if not self.capacity_bytes:
            return None
        return self.total_peak_bytes <= self.capacity_bytes and self.host_fits

    @property
    def host_fits(self) -> bool:
        return not self.host_capacity_bytes or self.host_bytes <= self.host_capacity_bytes

    def as_dict(self) -> dict:
        return asdict(self) | {"fits": self.fits}


def rank_memory(p: Parallel, rank_units: list, workload: Workload, dtype: str, grad_dtype: str,
                captured_saved_bytes: int, regenerated_bytes: int = 0, capacity_bytes: int = 0,
                host_capacity_bytes: int = 0) -> RankMemory:
    """The memory of the rank ``p`` (its stage) whose units are ``rank_units``; ``workload`` as the
    step runs (recomputation applied); ``captured_saved_bytes`` what the captured step saved before
    recomputation; ``regenerated_bytes`` what one layer's recomputed forward re-creates in backward."""
    expert, dense, saved, fp8_here, elements = _UNIT_TOTALS.get(
        (id(rank_units), workload.fp8_modules), (rank_units,), _unit_totals, rank_units, workload.fp8_modules)
    grad_size = DTYPES[grad_dtype].itemsize
    in_flight_chunks = _chunks_in_flight(p)
    in_flight = -(-in_flight_chunks // p.vpp)
    dropped = captured_saved_bytes - workload.saved_bytes  # saves that recomputation gave up
    transient = max(workload.activation_peak_bytes - captured_saved_bytes, 0) + regenerated_bytes
    states = model_state_bytes(dense, expert, dtype, grad_dtype, p.zero, p.replicas, p.ep)
    # FSDP2's reshard_after_forward=False: each unit's all-gathered parameters stay from its forward to its
    # backward, so at the end of the forward every unit's whole copy is held beside the shards
    gathered = (dense + expert) * DTYPES[dtype].itemsize if p.zero == 3 and not p.reshard_after_forward else 0
    if p.zero == 3 and p.post_forward_ranks:  # reshard_after_forward=N: each unit's 1/N clone, forward to backward
        gathered = (dense + expert) * DTYPES[dtype].itemsize // p.post_forward_ranks
    # --accumulate-unsharded: FSDP2 keeps each parameter's unsharded gradient, in the reduce dtype, between the
    # micro-batches that do not reduce-scatter (collectives.micro_batch_scatters), beside the last one's activations
    accumulated = (dense + expert) * grad_size if p.zero == 3 and p.accumulate_unsharded and p.micro_batches > 1 else 0
    activations = saved * in_flight_chunks // p.vpp
    # --activation-offload-layers (pp 1): the first N layers' saved tensors wait in host memory until backward
    offloaded = sum(u.saved() for u in rank_units if u.block != "dp" and u.layer is not None
                    and u.layer < p.activation_offload_layers)
    activations -= offloaded
    # FP8 copies of the rank's linear weights and their transposes (2 bytes a weight); under ZeRO 3 of its
    # shard (the gathered unit's FP8 weights are transient, as its 16-bit ones are). With --fp8-param-gather
    # under ZeRO 1/2 (Megatron-LM) the weights themselves are kept in FP8: 1 byte less each, and only the
    # transposes beside them
    # torchao's recipe keeps no FP8 copy between steps (workload/fp8.py): its casts are transient
    fp8_weights = 2 * fp8_here // (p.replicas if p.zero == 3 else 1) if workload.fp8_weights_kept else 0
    if p.fp8_param_gather and p.zero in (1, 2):
        states = (states[0] - fp8_here * (DTYPES[dtype].itemsize - 1), *states[1:])
        fp8_weights = fp8_here
    # one stage: the captured step is this rank's own, less what recomputation gives up; a stage of
    # several: its parts, added
    step_peak = workload.step_peak_bytes - dropped + regenerated_bytes if p.pp == 1 else (
        saved + transient + elements * grad_size)
    states, host = _offloaded(states, p.optimizer_offload, dtype, grad_size)
    total = sum(states) + gathered + accumulated + fp8_weights + activations + transient
    return RankMemory(parameters_bytes=states[0], gradients_bytes=states[1], optimizer_bytes=states[2],
                      activations_bytes=activations, transient_bytes=transient, step_peak_bytes=step_peak,
                      total_peak_bytes=total, reserved_peak_bytes=total + workload.reserved_slack_bytes,
                      micro_batches_in_flight=in_flight, capacity_bytes=capacity_bytes, gathered_parameters_bytes=gathered,
                      accumulated_gradients_bytes=accumulated,
                      fp8_weights_bytes=fp8_weights, host_bytes=host + offloaded,
                      host_capacity_bytes=host_capacity_bytes)


def _offloaded(states: tuple[int, int, int], share: float, dtype: str, grad_size: int) -> tuple[tuple, int]:
    """Model states on the GPU and bytes on the host when ``share`` of the optimizer shard is stepped on the
    host (cluster/offload.py): the GPU frees the offloaded parameters' two moments; the host holds their
    fp32 copy, moments and a pinned gradient buffer."""
    if not share:
        return states, 0
    adam = ADAM_BYTES_PER_PARAMETER["fp32" if dtype == "fp32" else "mixed"]
    offloaded = int(share * states[2] / adam)  # parameters of the shard stepped on the host
    on_gpu = states[2] - offloaded * MOMENTS_BYTES_PER_PARAMETER
    return (states[0], states[1], on_gpu), offloaded * (HOST_COPY_BYTES_PER_PARAMETER + grad_size)


# a layout search asks for the memory of the same device's units under every ZeRO stage and schedule
_UNIT_TOTALS = Memo(4096)


def _unit_totals(rank_units: list, fp8_modules: frozenset) -> tuple[int, int, int, int, int]:
    """(expert, dense) parameters, saved bytes, FP8 linear weights and all parameters of the units (the
    data-parallel rows left out)."""
    units = [u for u in rank_units if u.block != "dp"]
    elements = sum(g.elements for u in units for g in u.grads)
    expert = sum(g.elements for u in units for g in u.grads if is_expert(g.module))
    return expert, elements - expert, sum(u.saved() for u in units), fp8_weight_elements(units, fp8_modules), elements


def fp8_weight_elements(units, fp8_modules: frozenset) -> int:
    """--fp8: the weights of these units that have FP8 copies (the decoder layers' linear layers)."""
    return sum(g.elements for u in units for g in u.grads if g.module in fp8_modules)


def _chunks_in_flight(p) -> int:
    """Forward passes of one model chunk (1/vpp of the stage) whose activations a stage holds at
    its peak: Megatron's warm-up forwards plus one. 1F1B: pp - stage; interleaved, on the first
    stage pp·vpp + pp - 1, i.e. pp(1 + (pp - 1)/(pp·vpp)) micro-batches (Korthikanti et al. 2022)."""
    if p.vpp == 1:
        return min(p.pp - p.stage, p.micro_batches)
    return min((p.pp - p.stage - 1) * 2 + (p.vpp - 1) * p.pp + 1, p.micro_batches * p.vpp)


def model_state_bytes(dense: int, expert: int, dtype: str, grad_dtype: str, zero: int, dp: int,
                      ep: int = 1) -> tuple[int, int, int]:
    """(parameters, gradients, Adam optimizer states) bytes of one rank holding ``dense`` and
    ``expert`` parameters, as ZeRO ``zero`` divides them over the data-parallel group."""
    adam = ADAM_BYTES_PER_PARAMETER["fp32" if dtype == "fp32" else "mixed"]
    dense_dp, expert_dp = dp, expert_replicas(dp, ep)

    def divided(bytes_per_parameter: int, from_stage: int) -> int:
        if zero < from_stage:
            return (dense + expert) * bytes_per_parameter
        return -(-dense * bytes_per_parameter // dense_dp) + -(-expert * bytes_per_parameter // expert_dp)

    return divided(DTYPES[dtype].itemsize, 3), divided(DTYPES[grad_dtype].itemsize, 2), divided(adam, 1)


def describe_fit(memory: RankMemory, device_name: str) -> str:
    total = memory.total_peak_bytes / 2 ** 30
    if memory.fits is None:
        return f"{total:.2f} GiB (device '{device_name}' states no memory capacity)"
    capacity = memory.capacity_bytes / 2 ** 30
    host = f"; {memory.host_bytes / 2 ** 30:.2f} GiB on the host (offloaded)" if memory.host_bytes else ""
    if not memory.host_fits:
        return (f"{total:.2f} GiB of {capacity:.1f} GiB, but {memory.host_bytes / 2 ** 30:.2f} GiB offloaded to the "
                f"host's {memory.host_capacity_bytes / 2 ** 30:.1f} GiB share: does NOT fit")
    if memory.fits:
        return f"{total:.2f} GiB of {capacity:.1f} GiB: fits, {capacity - total:.2f} GiB free{host}"
    return f"{total:.2f} GiB of {capacity:.1f} GiB: does NOT fit, {total - capacity:.2f} GiB over{host}"

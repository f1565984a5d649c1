"""The optimizer offloaded to the host: Megatron-Core's HybridDeviceOptimizer.

``--optimizer-offload F`` (Megatron-Core's ``--optimizer-cpu-offload --optimizer-offload-fraction F``, which
needs the distributed optimizer: ZeRO 1 here) steps that share of each rank's optimizer shard on the
host CPU (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py):

- each offloaded parameter has a pinned host copy (fp32) with its Adam moments in host memory; on the
  GPU its fp32 main parameter stays (the step's result is copied back into it), so the GPU frees the two
  moments, 8 bytes a parameter, and the host holds 12 (copy and moments) plus a pinned gradient buffer;
- a step copies the offloaded gradients to the host on a D2H stream while the GPU steps its own share;
  one CPU optimizer per parameter (``overlap_cpu_optimizer_d2h_h2d``, on by default) steps each as its
  gradient lands, and copies it back on an H2D stream as the next one steps: the three stages pipeline
  over the parameters, so the offloaded share takes the longest of them, beside the GPU's share.

The CPU's Adam is torch.optim.AdamW on CPU tensors with ``fused=True`` (Megatron-Core's cpu_optimizer_cls and
its defaults, megatron/core/optimizer/__init__.py: "this flag is used to improve the performance of the cpu
optimizer"): torch's fused kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) steps each element in one
pass, reading the parameter, its gradient and both moments and writing the parameter and the moments: 7 fp32
values, 28 bytes a parameter, at the GPU's share of the host's DRAM bandwidth. (Without ``fused`` it runs its
single-tensor loop: eight whole-tensor passes, 80 bytes.) How many CPU threads step it is the launcher's:
torchrun with several processes a node and Ray's actors set OMP_NUM_THREADS=1, where one core's bandwidth,
not the DRAM share, bounds it; that is not modelled (docs/cluster.md).
Links and DRAM reach a share of their datasheet rates (assumed, as no measurement is at hand):
"""

from __future__ import annotations

from ..cost.devices import DeviceProfile
from ..errors import UserError

HOST_LINK_EFFICIENCY = 0.8  # assumed: pinned cudaMemcpyAsync over PCIe Gen4/5 x16 reaches about 80 % of the raw rate
HOST_MEMORY_EFFICIENCY = 0.7  # assumed: a streaming CPU kernel over both sockets' DDR reaches about 70 % of peak
CPU_ADAM_BYTES_PER_PARAMETER = 28  # torch's fused AdamW on CPU: 4 fp32 reads and 3 writes in one pass (above)
MAIN_PARAMETER_BYTES = 4  # the fp32 main parameter copied back to the GPU
# what the GPU frees and the host holds per offloaded parameter: parallel/memory.py


def check_host_tier(device: DeviceProfile) -> None:
    if not (device.host_link_bytes_per_s and device.host_memory_bytes_per_s):
        raise UserError(f"device '{device.name}' gives no host memory tier (host_link_bytes_per_s, "
                        "host_memory_bytes_per_s): offload needs them; use a profile that has them (h100-sxm, "
                        "h200, b200, gb200, a100-80gb) or add them to yours")


def offloaded_step_ns(parameters: float, grad_itemsize: int, device: DeviceProfile) -> dict[str, float]:
    """The offloaded share's three stages for ``parameters`` of the rank's shard, ns: gradients to the host,
    the CPU's Adam, the updated parameters back."""
    check_host_tier(device)
    link = device.host_link_bytes_per_s * HOST_LINK_EFFICIENCY
    dram = device.host_memory_bytes_per_s * HOST_MEMORY_EFFICIENCY
    return {"d2h": 1e9 * parameters * grad_itemsize / link,
            "cpu_adam": 1e9 * parameters * CPU_ADAM_BYTES_PER_PARAMETER / dram,
            "h2d": 1e9 * parameters * MAIN_PARAMETER_BYTES / link}

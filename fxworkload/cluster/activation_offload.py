"""Activations offloaded to host memory: Megatron-Core's layer-level CPU offloading.

``--activation-offload-layers N`` is Megatron-Core's ``--cpu-offloading --cpu-offloading-num-layers N`` with
activations offloaded (weights not), which runs Transformer Engine's ``get_cpu_offload_context``
(transformer_engine/pytorch/cpu_offload.py, ``OffloadSynchronizer._default_offload_sync_init``, read at
NVIDIA/TransformerEngine 00382b9):

- the tensors the rank's first N decoder layers save for backward are copied to pinned host memory on one
  offload stream, each layer's as its forward ends; layer i's copy must be done before layer L - N + i's
  forward starts (L: the rank's layers), so the GPU never holds more than L - N layers' activations;
- in backward, layer i's copy back starts as layer L - 1 - N + i's backward starts, on the same stream, and
  layer i's backward waits for it: with N = L - 1 every reload starts at its own layer's backward and is
  wholly exposed;
- the one stream carries both directions in order.

Megatron-Core refuses it with pipeline parallelism and with activation recomputation, and N must be below
the layers' count (megatron/core/transformer/transformer_config.py, ``__post_init__``). The copies run at the
host link's rate (cluster/offload.py: its assumed efficiency); their SM and HBM use beside the compute is not
modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cost.devices import DeviceProfile
from .offload import HOST_LINK_EFFICIENCY, check_host_tier


@dataclass(frozen=True)
class OffloadedPass:
    """One micro-batch's forward and backward beside the activations' copies, times from its forward's start."""
    forward_waits_ns: tuple[float, ...]  # per decoder layer: its forward waiting for a copy out to end
    backward_waits_ns: tuple[float, ...]  # per decoder layer: its backward waiting for its copy back
    copies_ns: tuple[tuple[float, float, float, float], ...]  # per offloaded layer: out start, end; back start, end

    @property
    def forward_wait_ns(self) -> float:
        return sum(self.forward_waits_ns)

    @property
    def backward_wait_ns(self) -> float:
        return sum(self.backward_waits_ns)


def copy_ns(saved_bytes: float, device: DeviceProfile) -> float:
    """One layer's saved activations over the host link, one way."""
    check_host_tier(device)
    return 1e9 * saved_bytes / (device.host_link_bytes_per_s * HOST_LINK_EFFICIENCY)


def offloaded_pass(forward_ns: list[float], backward_ns: list[float], copies_ns: list[float], offloaded: int,
                   head_ns: float = 0.0) -> OffloadedPass:
    """The two-stream timeline of one micro-batch: ``forward_ns[j]`` and ``backward_ns[j]`` are decoder layer
    j's compute, ``copies_ns[i]`` layer i's copy one way, ``head_ns`` what runs between the last layer's
    forward and its backward (the head and the loss, both directions)."""
    layers, kept = len(forward_ns), len(forward_ns) - offloaded
    forward_waits, backward_waits = [0.0] * layers, [0.0] * layers
    stream, out, back = 0.0, {}, {}
    t = 0.0
    for j in range(layers):
        if j - kept >= 0:  # layer j - kept's copy out must be done before this forward starts
            forward_waits[j] = max(0.0, out[j - kept][1] - t)
            t += forward_waits[j]
        t += forward_ns[j]
        if j < offloaded:
            start = max(t, stream)
            stream, out[j] = start + copies_ns[j], (start, start + copies_ns[j])
    t += head_ns
    for k in reversed(range(layers)):
        i = k - (kept - 1)
        if 0 <= i < offloaded:  # this layer's backward starts layer i's copy back
            start = max(t, stream)
            stream, back[i] = start + copies_ns[i], (start, start + copies_ns[i])
        if k < offloaded:
            backward_waits[k] = max(0.0, back[k][1] - t)
            t += backward_waits[k]
        t += backward_ns[k]
    return OffloadedPass(tuple(forward_waits), tuple(backward_waits),
                         tuple((*out[i], *back[i]) for i in range(offloaded)))

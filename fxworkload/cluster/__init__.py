"""Cluster: the whole cluster's training step.

Collective and point-to-point times from NCCL's cost model (``network``), Megatron-LM's pipeline
schedules simulated over every stage (``schedule``), and the step with data-parallel overlap,
the optimizer and utilisation (``step``).
May import: ``parallel``, ``workload``, ``capture``, ``cost``, ``fxworkload.errors``, ``fxworkload.dtypes``.
"""

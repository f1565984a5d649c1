"""Parallel: one rank of a Megatron-LM style layout.

Holds the settings and their checks (``layout``), tensor/expert sharding of the meta model
(``tensor_parallel``), the layer-level units of a table (``units``), the collectives each unit
runs (``collectives``) and the rank's stage with all of it attached (``rank``).
May import: ``workload``, ``capture``, ``cost``, ``fxworkload.errors``, ``fxworkload.dtypes``.
"""

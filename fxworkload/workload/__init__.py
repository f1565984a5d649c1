"""Workload: the per-node table of one training step and how it is made fast.

Holds the table itself and its costing (``table``: OpCost, NodeRow, GradRow, Workload, build,
recost), the fast path where one captured layer stands for every identical one (``layers``), and
the on-disk cache of captured tables (``cache``).
May import: ``capture``, ``cost``, ``fxworkload.errors``, ``fxworkload.dtypes``.
"""

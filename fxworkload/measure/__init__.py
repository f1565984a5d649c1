"""Measure: real times on this machine, and estimates held against them.

Holds clocks (``timing``), the node-by-node timed run of a step (``profile``), micro-benchmarks
that write a device profile (``calibrate``), and estimated-vs-measured reports (``compare``).
May import: ``workload``, ``capture``, ``cost``, ``fxworkload.errors``, ``fxworkload.dtypes``.
Never ``formats`` (it writes no files) nor anything above.
"""

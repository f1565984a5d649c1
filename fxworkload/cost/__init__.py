"""Cost: what one op costs, from its shapes alone.

Holds the FLOP rules (``flops``), bytes moved (``traffic``), device profiles as frozen data with a
source per figure (``devices``), and the op-time model that turns FLOPs, bytes and shapes into
nanoseconds on a device (``roofline``).
May import: ``fxworkload.errors``, ``fxworkload.dtypes``, torch. Never capture or anything above:
costing never traces, and loading a device profile never measures.
"""

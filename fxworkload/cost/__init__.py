"""Cost: what one op costs, from its shapes alone.

Holds the FLOP rules (``flops``), bytes moved (``traffic``), device profiles as frozen data with a
source per figure (``devices``), and the op-time models that turn FLOPs, bytes and shapes into
nanoseconds: the roofline for CPUs and calibrated tables (``roofline``), the GPU mechanics model
(``gpu``) with its fitted parameters (``fits/``), and which model an op takes on a GPU (``optime``).
May import: ``fxworkload.errors``, ``fxworkload.dtypes``, torch. Never capture or anything above:
costing never traces, and loading a device profile never measures.
"""

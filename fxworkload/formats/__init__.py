"""Formats: what is written and read back, as text.

Holds the per-node TSV/JSON tables and summaries (``tables``), SimAI workload files (``simai``),
Chrome/Perfetto traces (``chrome_trace``) and all-or-none file writing (``files``).
May import: ``parallel``, ``workload``, ``capture``, ``cost``, ``fxworkload.errors``,
``fxworkload.dtypes``. Never ``measure`` nor anything above.
"""

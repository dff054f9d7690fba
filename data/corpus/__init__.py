"""Offline corpus tools: the global shuffle, the split by source, the demo corpus builder.

They prepare parquet shards before a run; the training-time data path (``data/*.py``) never imports
them (a test enforces it).
"""

PAGE_OPTIONS = {"write_batch_size": 64, "data_page_size": 1 << 20}
"""How the tools write parquet for training: data pages of ~1 MiB, whatever the document lengths.

A consumer keeps one scan open per open chunk (sources x ``data.open_shards``: 32 at the real defaults),
and each scan holds one decompressed data page (data/reader.py). pyarrow's writer checks the page size
only every ``write_batch_size`` rows (1,024 by default), so with Dolma3-length documents a page holds
~1,024 of them (~19 MB) and the scans alone take ~600 MB per consumer; checked every 64 rows, a page
stays near ``data_page_size`` (docs/benchmarks.md: peak RSS per consumer with both layouts)."""

"""Offline corpus tools: the global shuffle, the split by source, the demo corpus builder.

They prepare parquet shards before a run; the training-time data path (``data/*.py``) never imports
them (a test enforces it).
"""

"""Ablations as config diffs: the scheduled-vs-fixed mixture pair, its runner and its report.

``ablations/`` imports ``train/`` and ``data/``, never the other way round (tests/unit/test_layers.py
checks it). See ablations/README.md.
"""

"""Tools that run on a training run, not in it: the GPU check (and its in-run step clock), evaluation and
the Hugging Face export. ``python -m train fit`` never imports this package (tests/unit/test_training_imports.py),
as the data path never imports data/corpus/."""

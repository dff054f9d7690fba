"""One error type for bad configuration or bad input data, raised before any compute is spent.

Messages name the file, config key or flag at fault and say what to do about it.
"""


class ConfigError(ValueError):
    """A configuration value, a flag, or an input file is unusable."""

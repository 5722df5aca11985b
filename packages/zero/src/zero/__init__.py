"""DeepSpeed-compatible engine, config, initialize() and the `zero` CLI over the zero-* packages."""

__version__ = "0.1.0"

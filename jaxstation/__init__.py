"""jaxstation: a batched, batch-invariant LLM serving station in JAX."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("jaxstation")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

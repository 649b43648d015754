"""jaxstation: a batched, batch-invariant LLM serving station in JAX.

`from jaxstation import LLM, SamplingParams` is the offline Python API (docs/python.md); it is imported when first
named, so that the command line's `--version` and `--help` never load JAX."""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("jaxstation")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_OFFLINE = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput")
__all__ = ["__version__", *_OFFLINE]


def __getattr__(name: str) -> Any:
    if name in _OFFLINE:
        from jaxstation.offline import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'jaxstation' has no attribute {name!r}")

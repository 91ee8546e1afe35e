"""graphcache: a graph-caching LLM inference microservice."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

try:  # the installed distribution's version (pyproject.toml), as `graphcache --version` and GET /version say
    __version__ = _distribution_version("graphcache")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]

"""edgesplit: split training across heterogeneous edge devices and GPU servers.

This package holds only the command-line entry point and process settings; the roles live in
``coordinator``, ``edge_client`` and ``storage``, the shared split core in ``split_models``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

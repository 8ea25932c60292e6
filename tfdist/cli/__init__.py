"""Command-line entry points (one module per command): thin wrappers over the library."""

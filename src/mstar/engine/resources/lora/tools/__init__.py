"""Consumers of the library, not parts of it: the command line, the demo, sample adapters, and the
hook that runs the pool inside a transformers model."""

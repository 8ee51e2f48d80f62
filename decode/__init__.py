"""pdserve.decode: the decode role of the engine (role.py; docs/architecture.md)."""

"""pdserve.prefill: the prefill role of the engine (role.py; docs/architecture.md)."""

"""pdserve.prefill (see DESIGN.md)."""

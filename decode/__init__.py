"""pdserve.decode (see DESIGN.md)."""

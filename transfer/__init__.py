"""pdserve.transfer (see DESIGN.md)."""

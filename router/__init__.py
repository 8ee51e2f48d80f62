"""pdserve.router (see DESIGN.md)."""

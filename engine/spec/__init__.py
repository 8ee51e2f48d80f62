"""Speculative decoding: its settings (a leaf), drafters, verification and the off-switch."""

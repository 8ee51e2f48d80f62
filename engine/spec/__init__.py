"""Speculative decoding (its settings: base/speculative.py).

    decode   proposing and verifying draft tokens in a decode step
    draft    the draft model's own runner
    switch   the off-switch: speculation only where it pays
"""

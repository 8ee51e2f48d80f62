"""Where a request goes: pure placement functions over worker snapshots (routing.py), what
placement reads of the pools (pool_view.py), a handoff's learned cost (handoff_cost.py) and the
`Placer` (placement.py)."""

"""The prefill and decode pools and their scaling: `Pools` (pools.py: sizes, each worker's
lifecycle), their monitor (pool_monitor.py: probes, refills, autoscaling), the autoscaling policy
(autoscale.py) and the prefill:decode ratio planner (ratio.py)."""

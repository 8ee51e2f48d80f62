"""Faults: a (prefill, decode) pair's KV link probed back into placement (links.py), the Ray
pdserve starts or joins and the watch on it (local_ray.py), and what a killed server's Ray
left ended (reaper.py)."""

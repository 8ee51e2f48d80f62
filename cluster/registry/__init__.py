"""The cluster-wide block registry: the named, restartable actor (registry.py) and the
cluster's guarded link to it (registry_link.py)."""

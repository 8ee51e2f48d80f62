"""The KV tiers below the GPU.

    tier       the protocol every tier keeps (lookup, load, ready, store, evict) and the engine's list
    offload    the host tier: its index (`HostIndex`) and pinned buffer (`HostCache`)
    persist    the host tier saved as the disk tier's block files and read back at start
    disk       block files on disk (`DiskStore`)
    disk_tier  the disk tier behind the host tier
"""

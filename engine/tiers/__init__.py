"""The KV tiers below the GPU.

    offload    the host tier: its index (`HostIndex`) and pinned buffer (`HostCache`)
    persist    the host tier saved to a file and read back at start
    disk       block files on disk (`DiskStore`)
    disk_tier  the disk tier behind the host tier
"""

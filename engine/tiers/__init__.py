"""The KV tiers below the GPU: the host tier and its copy on disk."""

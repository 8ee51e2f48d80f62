"""One worker: its Ray actor (worker_actor.py), its engine thread (engine_loop.py) and the commands
posted to it, its shards (shard_actor.py), where its outputs go (outlets.py, output_pipe.py), what
it asks other workers (peer_calls.py) and which GPUs it sees (gpus.py)."""

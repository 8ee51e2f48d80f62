"""The engine's floor: what every layer above uses and that uses nothing of theirs.

    tp             the tensor-parallel group and its sharding rules
    stores         TCPStores that listen on one address (the group's rendezvous)
    step_channel   the shared-memory channel a TP step's inputs cross to ranks 1..N-1
    cuda_ipc       a CUDA tensor of one process opened in another (the KV pull's, the all-reduce's)
    ipc_allreduce  the TP group's one-shot all-reduce over CUDA IPC buffers
    host_to_device copies through pinned memory
    hashing        chained block hashes (the prefix cache's and the registry's keys)
    kv_layout      `KVLayout`: the one description of a KV cache's bytes
    kv_window      the sliding KV window's geometry and key rotation
    speculative    `SpeculativeConfig`, speculative decoding's settings
    grammar_spec   a structured-outputs spec's shape and `GrammarBudget`
"""

"""From logits to tokens.

    sampler         greedy, temperature, top-k/p/min-p, logprobs; speculative tokens' verification
    verify          accepting or rejecting draft tokens (greedy and sampled)
    sampling_noise  seeded per-request noise
    logits_process  penalties, logit bias, allowed and banned tokens
    structured      grammars (xgrammar): compile, masks, accept
"""

"""From logits to tokens.

    sampler         greedy, temperature, top-k/p/min-p, logprobs; speculative tokens' verification
    slots           each live request's sampling parameters in one device table (a row per request)
    verify          accepting or rejecting draft tokens (greedy and sampled)
    sampling_noise  seeded per-request noise
    logits_process  penalties, logit bias, allowed and banned tokens
    structured      grammars (xgrammar): compile, masks, accept
"""

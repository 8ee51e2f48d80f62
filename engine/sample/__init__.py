"""From logits to tokens: the sampler, seeded noise, logits processors and grammar masks."""

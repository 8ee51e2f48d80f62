"""The model families over one floor of shared layers (docs/architecture.md, section 2a).

    protocol       `CausalLM`: what the runner, graphs and loader use of a model
    layers         norms, parallel linears, MLP, rotary, fused-op hooks, the decoder stack
    attention      paged attention: metadata, the step's `AttentionPlan`, the backend
    mla_attention  paged latent attention (MLA), the same interface
    moe            sparse expert layers
    llama          Llama, Qwen2/3, Mistral and their kin
    deepseek       DeepSeek-V2/V3 (MLA and MoE)
"""

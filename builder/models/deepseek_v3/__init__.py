"""DeepSeek-V3: multi-head latent attention and a mixture of experts with expert parallelism."""

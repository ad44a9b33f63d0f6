"""Model sizes by name: keyword arguments of `ModelConfig` (`--config.model.name`). The tiny
size takes vocab_size from the vocabulary; the accelerator shapes carry their own."""

SIZES = {
    # Smoke tests and resumption tests: compiles in seconds.
    "micro": dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64,
                  tie_embeddings=True),
    # CPU: trains in minutes on the embedded task.
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=512,
                 tie_embeddings=True, rope_theta=10_000.0),
    # MoE twins of the two (4 experts, 2 per token, each half the dense MLP): routing replay,
    # the evidence ablation of `pbsd.replay_routing`.
    "micro-moe": dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64,
                      num_experts=4, num_experts_per_tok=2, expert_mlp_dim=32,
                      tie_embeddings=True),
    "tiny-moe": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=512,
                     num_experts=4, num_experts_per_tok=2, expert_mlp_dim=256,
                     tie_embeddings=True, rope_theta=10_000.0),
    # CPU benchmarks: enough work per decode step that it outweighs the per-op dispatch (which
    # every fake CPU device of a mesh repeats).
    "small": dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, mlp_dim=2048,
                  tie_embeddings=True, rope_theta=10_000.0),
    # Accelerator shapes of public checkpoints (weights: scripts/convert_hf.py, then
    # --config.model.init_dir=DIR).
    "qwen2.5-0.5b": dict(vocab_size=151_936, hidden_size=896, num_layers=24, num_heads=14,
                         num_kv_heads=2, head_dim=64, mlp_dim=4864, qkv_bias=True,
                         tie_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    # The paper's model (configs/search_r1.py).
    "qwen2.5-3b": dict(vocab_size=151_936, hidden_size=2048, num_layers=36, num_heads=16,
                       num_kv_heads=2, head_dim=128, mlp_dim=11_008, qkv_bias=True,
                       tie_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "qwen3-0.6b": dict(vocab_size=151_936, hidden_size=1024, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, mlp_dim=3072, qk_norm=True,
                       tie_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "qwen3-8b": dict(vocab_size=151_936, hidden_size=4096, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, mlp_dim=12_288, qk_norm=True,
                     tie_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "llama3-8b": dict(vocab_size=128_256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, mlp_dim=14_336, tie_embeddings=False,
                      rope_theta=500_000.0, rms_norm_eps=1e-5),
}

"""The Qwen3 / llama runner: config, loaders, forward, generate."""

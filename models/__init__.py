"""Plain-PyTorch models and their presets. Nothing here imports distributed, compile or kernel code."""

from models.gpt import GPT, PRESETS, GPTConfig, build_gpt

MODEL_PRESETS: dict[str, GPTConfig] = dict(PRESETS)


def build_model(cfg: GPTConfig) -> GPT:
    """The model for a config (called under torch.device("meta"), then to_empty + init_weights)."""
    return build_gpt(cfg)


__all__ = ["GPT", "MODEL_PRESETS", "GPTConfig", "build_model"]

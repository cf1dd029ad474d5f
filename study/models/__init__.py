"""Model definitions. The configs import without torch; the modules need it."""

from study.models.config import FFNConfig, ModelConfig

__all__ = ["FFNConfig", "ModelConfig"]

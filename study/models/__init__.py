"""The models of both studies: llama and olmo2 blocks with SwiGLU or hourglass FFNs (`transformer`, `layers`)."""

from study.models.transformer import Transformer, build_model

__all__ = ["Transformer", "build_model"]

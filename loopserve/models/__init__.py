"""Looped model architectures and native checkpoint loading."""

from loopserve.models.config import OuroConfig
from loopserve.models.loader import load_model, resolve_model_path, save_model
from loopserve.models.ouro import OuroForLoopedLM

__all__ = ["OuroConfig", "OuroForLoopedLM", "load_model", "resolve_model_path", "save_model"]

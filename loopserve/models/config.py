"""Architecture description of an Ouro-style looped model, read from `config.json`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from loopserve.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("ouro",)


def read_config_json(path: str | os.PathLike) -> dict:
    """A checkpoint's `config.json` as read (any family)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_config_json(directory: str | os.PathLike, raw: dict) -> None:
    Path(directory, "config.json").write_text(json.dumps(raw, indent=2) + "\n")


class ConfigFile:
    """What every family's config dataclass shares with its `config.json`: reading it back
    (`from_file`), the written form (`to_dict`: the fields, eos ids as a list, unknown keys
    kept in `extra`, the `ARCHITECTURE` name; a family adds its own keys in `_written`),
    `save`, and building from a parsed dict with a clear error for a missing field."""

    ARCHITECTURE = ""

    @classmethod
    def from_file(cls, path: str | os.PathLike):
        return cls.from_dict(read_config_json(path))  # type: ignore[attr-defined]

    @classmethod
    def _build(cls, raw: dict, known, kwargs: dict):
        """The config of `kwargs` from `raw` (unknown keys into `extra`)."""
        extra = {k: v for k, v in raw.items() if k not in known and k != "eos_token_id"}
        try:
            return cls(**kwargs, eos_token_id=eos_token_ids(raw), extra=extra)  # type: ignore[call-arg]
        except TypeError as err:
            raise ModelLoadError(f"config.json is missing a required field: {err}") from err

    def _written(self, raw: dict) -> dict:
        return raw

    def to_dict(self) -> dict:
        raw = asdict(self)  # type: ignore[call-overload]
        raw.pop("extra")
        raw["eos_token_id"] = list(self.eos_token_id)  # type: ignore[attr-defined]
        raw["architectures"] = [self.ARCHITECTURE]
        return {**self.extra, **self._written(raw)}  # type: ignore[attr-defined]

    def save(self, directory: str | os.PathLike) -> None:
        write_config_json(directory, self.to_dict())


def once_kv_planes(once_layers: int, layers_per_plane: int) -> int:
    """Planes a request holds beyond its step planes for the layers that keep one K/V entry
    per position (a prelude's and coda's attention layers): every plane has the core's
    `layers_per_plane` layers, so `once_layers` of them fill ceil(once / core) planes, the
    last partly. The one formula the engine (cache tensor, KV manager) and the simulator
    (memory plan) size K/V by; `once_layer_slot` maps a layer onto it."""
    return -(-once_layers // layers_per_plane) if once_layers else 0


def once_layer_slot(once_index: int, layers_per_plane: int) -> tuple[int, int]:
    """(plane offset among the once planes, layer within the plane) of the `once_index`-th
    once-per-position layer (prelude layers first, then coda layers)."""
    return divmod(once_index, layers_per_plane)


def eos_token_ids(raw: dict) -> tuple[int, ...]:
    """`eos_token_id` of a config as a tuple (absent, one id or a list)."""
    eos = raw.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)


@dataclass(frozen=True)
class OuroConfig(ConfigFile):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    total_ut_steps: int = 4
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str = "ouro"
    extra: dict = field(default_factory=dict, compare=False, repr=False)
    ARCHITECTURE = "OuroForCausalLM"

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ModelLoadError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.total_ut_steps < 1:
            raise ModelLoadError(f"total_ut_steps must be >= 1, got {self.total_ut_steps}")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_loops(self) -> int:
        """D: how many times the core runs per token."""
        return self.total_ut_steps

    @property
    def kv_elements_per_token_per_depth(self) -> int:
        """K and V elements one token stores per depth (multiply by the dtype size for bytes)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    def kv_bytes_per_block(self, block_size: int, element_size: int) -> int:
        """Bytes of one KV block of one plane: `block_size` positions of every layer's K and V."""
        return self.kv_elements_per_token_per_depth * block_size * element_size

    # The `LoopedConfig` seam (models/family.py).
    def with_loops(self, num_loops: int) -> OuroConfig:
        """The same model run `num_loops` loops per token (`total_ut_steps`)."""
        return replace(self, total_ut_steps=num_loops)

    num_core_layers = property(lambda self: self.num_hidden_layers)
    num_prelude_layers = property(lambda self: 0)  # the embedding only
    num_coda_layers = property(lambda self: 0)  # the lm_head only

    @property
    def extra_kv_planes(self) -> int:
        """Planes beyond the layout's: none (Ouro's prelude and coda have no attention)."""
        return 0

    @property
    def step_extra_params(self) -> int:
        """Read once per loop besides the layers: the final `model.norm`."""
        return self.hidden_size

    @property
    def exit_gate_params(self) -> int:
        """`model.early_exit_gate`: Linear(hidden, 1) with bias."""
        return self.hidden_size + 1

    @classmethod
    def from_dict(cls, raw: dict) -> OuroConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"config.json has model_type {model_type!r}, not Ouro's {SUPPORTED_MODEL_TYPES}"
            )
        if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ()):
            raise ModelLoadError("sliding-window attention layers are not supported yet")
        scaling = raw.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ModelLoadError(f"rope_scaling {scaling!r} is not supported yet")
        known = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "total_ut_steps", "head_dim",
            "rope_theta", "rms_norm_eps", "max_position_embeddings", "hidden_act",
            "tie_word_embeddings", "bos_token_id", "pad_token_id", "model_type",
        }  # fmt: skip
        kwargs = {k: raw[k] for k in known if k in raw and raw[k] is not None}
        kwargs.setdefault("num_key_value_heads", raw["num_attention_heads"])
        return cls._build(raw, known, kwargs)

"""Native checkpoint loading: Hugging Face directories of safetensors, no remote code.

`load_model(path_or_id)` resolves a local directory or a Hub id (through the local Hugging
Face cache; downloading only with an explicit opt-in), reads `config.json`, picks the model
family from it (`models/registry.py`), checks every tensor name strictly and returns the
family's model (`OuroForLoopedLM`, `HuginnForLoopedLM`) in the requested dtype and device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from loopserve.errors import ConfigError, ModelLoadError
from loopserve.models.ouro import OuroForLoopedLM

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
DOWNLOAD_ENV = "LOOPSERVE_ALLOW_DOWNLOAD"


class _SkipInitialisation(TorchFunctionMode):
    """While a model is built on the meta device to receive a checkpoint's tensors: the random
    and constant fills of its modules' `reset_parameters` (nn.Linear, nn.Embedding) are
    skipped. A meta tensor has no values to fill, and on one these fills run torch's Python
    reference kernels, whose first use imports torch._dynamo: about one CPU-second in every
    process that loads a model (an engine over the embedded model built in 1.15 CPU-seconds
    with the fills, 0.01 without, 2-vCPU Xeon). A torch function mode is per thread, so a
    model built at the same time on another thread is initialised as usual."""

    FILLS = frozenset(
        [getattr(torch.Tensor, name) for name in ("normal_", "uniform_", "fill_", "zero_")]
        + [
            getattr(torch.nn.init, name)
            for name in ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_")
            + ("ones_", "constant_", "xavier_uniform_", "xavier_normal_", "kaiming_normal_")
        ]
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS:
            tensor = args[0] if args else kwargs.get("tensor")
            if tensor is not None and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ModelLoadError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ModelLoadError(
            f"dtype {dtype!r} is not supported; use one of float32, bfloat16, float16"
        ) from None


def _hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    hf_home = os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")
    return Path(hf_home) / "hub"


def _cached_snapshot(cache_dir: Path, repo_id: str, revision: str) -> Path | None:
    """The snapshot of `repo_id` at `revision` (a branch or tag under refs/, or a commit) in a
    cache laid out as huggingface_hub lays it out: models--ORG--NAME/{refs,snapshots}."""
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    ref_file = repo_dir / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def opted_in(env_name: str) -> bool:
    """Whether the opt-in environment variable `env_name` is set: any value but empty, "0"
    or "false" (`LOOPSERVE_ALLOW_DOWNLOAD`, `LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN`)."""
    return os.environ.get(env_name, "") not in ("", "0", "false")


def resolve_model_path(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    allow_download: bool | None = None,
) -> Path:
    """A local checkpoint directory for a path or a Hub id such as `ByteDance/Ouro-1.4B`.

    A Hub id is looked up at `revision` (None: `main`) in `download_dir` (None: the Hugging
    Face cache, `HF_HUB_CACHE` or `HF_HOME/hub`); when it is not there it is downloaded into
    that cache only when downloads are allowed (`allow_download`, or `LOOPSERVE_ALLOW_DOWNLOAD=1`
    when None). Every failure is a `ModelLoadError` with one line that says what to do."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face checkpoint?")
        return path
    name = str(name_or_path)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ModelLoadError(f"model {name!r} is neither a local directory nor a Hub id")
    revision = revision or "main"
    cache_dir = Path(download_dir).expanduser() if download_dir is not None else _hub_cache_dir()
    snapshot = _cached_snapshot(cache_dir, name, revision)
    if snapshot is not None:
        return snapshot
    at = "" if revision == "main" else f" at revision {revision!r}"
    if allow_download is None:
        allow_download = opted_in(DOWNLOAD_ENV)
    if not allow_download:
        raise ModelLoadError(
            f"{name!r}{at} is not in the local Hugging Face cache ({cache_dir}). "
            f"Download it first (hf download {name}) or opt in with {DOWNLOAD_ENV}=1 / "
            "allow_download=True."
        )
    return _download(name, revision, cache_dir, at)


def _download(name: str, revision: str, cache_dir: Path, at: str) -> Path:
    """`snapshot_download` into `cache_dir`; any failure (offline, unknown id or revision, a
    gated repository, no network) is one `ModelLoadError` line, never a traceback."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        directory = Path(snapshot_download(name, revision=revision, cache_dir=cache_dir))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{name!r}{at} is not in {cache_dir} and could not be downloaded "
            "(offline: HF_HUB_OFFLINE is set or the Hub cannot be reached)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelLoadError(
            f"could not download {name!r}{at}: {type(err).__name__}: {first_line}"
        ) from None
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{name!r}{at} has no config.json; is it a looped LM checkpoint?")
    return directory


def _safetensor_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise ModelLoadError(f"shards listed in {index.name} are missing: {missing}")
        return [directory / f for f in files]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {directory}")
    return files


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensor_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in tensors:
                    raise ModelLoadError(f"tensor {name} appears in more than one shard")
                tensors[name] = f.get_tensor(name)
    return tensors


def _check_names(model, tensors: dict[str, torch.Tensor], family, tied: bool) -> None:
    expected = set(model.state_dict().keys())
    for name in family.ignored_tensors:
        tensors.pop(name, None)
    if tied:
        expected.discard(family.tied_head[0])
        tensors.pop(family.tied_head[0], None)
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:20])}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(unexpected[:20])}")
        raise ModelLoadError(
            f"checkpoint does not match the {family.name} architecture; " + "; ".join(parts)
        )


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "cpu",
    allow_download: bool | None = None,
    num_loops: int | None = None,
):
    """Load a checkpoint of any registered family into its model (eval mode, no grad).
    `num_loops`: run the core at most this many loops per token instead of the config's D
    (`LoopedConfig.with_loops`; the weights are the same for any loop count)."""
    from loopserve.models.registry import read_config

    directory = resolve_model_path(name_or_path, allow_download=allow_download)
    family, config = read_config(directory / "config.json")
    if num_loops is not None:
        config = config.with_loops(num_loops)
    tied = config.tie_word_embeddings
    torch_dtype = parse_dtype(dtype)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available")
    with torch.device("meta"), _SkipInitialisation():
        model = family.model_class(config)
    tensors = read_state_dict(directory)
    _check_names(model, tensors, family, tied)
    for name, tensor in tensors.items():
        expected_shape = model.get_parameter(name).shape
        if tensor.shape != expected_shape:
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(tensor.shape)}, config implies {tuple(expected_shape)}"
            )
    tensors = {k: v.to(device=device, dtype=torch_dtype) for k, v in tensors.items()}
    model.load_state_dict(tensors, strict=not tied, assign=True)
    if tied:
        model.lm_head.weight = model.get_parameter(family.tied_head[1])
    if isinstance(model, OuroForLoopedLM):
        model.rotary.to(device)  # computed on the host when built (RotaryEmbedding)
    merge = getattr(model, "merge_projections", None)
    if merge is not None and device.type == "cuda":
        # One GEMM for projections of one input (Ouro's q/k/v, gate/up): fewer kernels per
        # loop. Not on CPU, where the wider GEMM measured 3-6% slower at 8-64 rows
        # (docs/gpu.md, "Kernels per layer").
        merge()
    model.checkpoint_dir = directory
    return model.eval().requires_grad_(False)


def save_model(model, directory: str | os.PathLike, *, max_shard_bytes: int = 0) -> None:
    """Write `config.json` and safetensors (sharded with an index when `max_shard_bytes` > 0)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save(out)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if max_shard_bytes <= 0:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}  # fmt: skip
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def require_handoff(model: str | os.PathLike | None) -> None:
    """A clear error for prefill/decode disaggregation of a family without hand-off (None:
    the embedded default model, an Ouro checkpoint)."""
    if model is None:
        return
    from loopserve.models.registry import read_config

    family = read_config(resolve_model_path(model))[0]
    if not family.handoff:
        raise ConfigError(f"prefill/decode disaggregation is not supported for {family.name} yet")

"""`loopserve serve`: build the engine client the flags ask for and serve it over HTTP.

The client is an `AsyncLLM` (one engine in this process) or, with `--data-parallel-size` /
`--pd` / `--ray-address`, a Ray replica pool (distributed/); the server (server/) sees only
the `EngineClient` interface. `python -m loopserve.cli.serve` runs the same command.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from loopserve.distributed.args import (
    PROMPT_ARM_HELP,
    add_distributed_args,
    check_distributed_args,
    resolve_prefill_mode,
    uses_ray,
)
from loopserve.engine_args import add_engine_args, engine_args_from
from loopserve.server.args import add_server_args
from loopserve.threads import apply_cpu_threads

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `loopserve serve`: the model, positionally as `vllm serve MODEL` takes it (or
    `--model`), every engine flag, the distributed ones, the server's own."""
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="checkpoint dir or Hub id, as --model takes it (give one of the two)",
    )  # fmt: skip
    # Left out, --prefill-mode follows --kv-handoff (`resolve_prefill_mode`).
    add_engine_args(
        parser,
        defaults={"prefill_mode": None},
        helps={
            "prefill_mode": PROMPT_ARM_HELP + "(None: atomic, or per_depth with --kv-handoff "
            "stream, so each plane's blocks leave while the deeper loops run)"
        },
    )
    add_distributed_args(parser)
    add_server_args(parser)


def check_before_start(args: argparse.Namespace) -> str | None:
    """What `serve` checks before a port, a Ray cluster or a model load (after
    `resolve_prefill_mode` has filled in the prompt arm): the engine flags
    alone, `--model` resolved (once, here: every replica loads the same directory), the flags
    against the checkpoint's config.json (its family, exit signal, positions, loops) and the
    chat template (a file that is there and compiles; `args.chat_template` becomes its text,
    for replicas on other nodes). The error's one line, or None with `args` completed (the
    checkpoint's request defaults too)."""
    from loopserve.config import EngineConfig
    from loopserve.engine.model_setup import check_against_checkpoint
    from loopserve.errors import ConfigError, ModelLoadError
    from loopserve.models.config import read_config_json
    from loopserve.models.loader import resolve_model_path
    from loopserve.models.tiny import DEFAULT_MODEL_DIR
    from loopserve.server.args import with_checkpoint_defaults
    from loopserve.text.tokenizer import is_jinja, read_chat_template

    try:
        engine_config = EngineConfig.from_engine_args(**engine_args_from(args))
        if args.model is not None:
            args.model = str(
                resolve_model_path(
                    args.model, revision=args.revision, download_dir=args.download_dir
                )
            )
        checkpoint = Path(args.model or DEFAULT_MODEL_DIR)
        check_against_checkpoint(engine_config, checkpoint)
        if engine_config.chat_template is not None:
            template = read_chat_template(engine_config.chat_template)
            if is_jinja(template):  # replicas take it as the template itself
                args.chat_template = template
    except (ConfigError, ModelLoadError) as err:
        return str(err)
    args.request_defaults = with_checkpoint_defaults(
        args.request_defaults, read_config_json(checkpoint / "config.json")
    )
    return None


def main_from_args(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a graceful shutdown, 1 if the model failed to load,
    2 (with a one-line error) if the engine flags do not go together, alone or for the
    checkpoint's config.json (its family, exit signal, positions and loops), or `--model` is
    neither a checkpoint directory nor a Hub id that is cached (or, with downloads allowed,
    can be downloaded)."""
    take_model_tag(args)
    check_distributed_args(args)  # flag combinations first: a usage error costs nothing
    hint = resolve_prefill_mode(args)
    from loopserve.server.api_server import default_model_name  # lazy: a fast --help

    served_model_name = args.served_model_name or default_model_name(args.model)  # as given
    error = check_before_start(args)
    if error is not None:
        print(f"loopserve serve: error: {error}", file=sys.stderr)
        return 2
    from loopserve.distributed.launch import build_pool
    from loopserve.distributed.pool import ReplicaPool
    from loopserve.engine.async_llm import AsyncLLM
    from loopserve.engine.client import EngineClient
    from loopserve.engine.gc_heap import freeze_startup_heap
    from loopserve.engine.llm_engine import LLMEngine
    from loopserve.server.api_server import GracefulServer, make_server

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    apply_cpu_threads(args.device, args.torch_threads)  # the CPU thread policy (threads.py)
    if hint is not None:
        logger.info(hint)
    engine_args = engine_args_from(args)
    server: GracefulServer | None = None

    def stop_server(_err: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    client: EngineClient
    if uses_ray(args):
        client = build_pool(args, engine_args, on_load_error=stop_server)
    else:
        client = AsyncLLM(
            lambda: LLMEngine.from_engine_args(**engine_args),
            max_pending_requests=args.max_pending_requests,
            on_load_error=stop_server,
            freeze_heap=True,  # this process serves until it exits
        )
    server = make_server(client, args, served_model_name)
    if isinstance(client, ReplicaPool):  # PDReplicaPool too
        client.replica_set.init_ray()  # in the main thread, before uvicorn takes the signals
        # The router serves until it exits: its heap is frozen now (each replica freezes
        # its own once its engine has loaded; here the engine thread does, `freeze_heap`).
        logger.info("froze the start-up heap: %d objects no collection walks",
                    freeze_startup_heap())  # fmt: skip
    server.run()
    if client.load_error is not None:
        logger.error("the model failed to load: %s", client.load_error)
        return 1
    return 0


def take_model_tag(args: argparse.Namespace) -> None:
    """`loopserve serve MODEL`: the positional model is `--model`'s value; both, naming two
    models, are a usage error."""
    from loopserve.errors import UsageError

    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise UsageError(
            f"two models: {tag!r} (positional) and --model {args.model!r}; give one of them"
        )
    args.model = tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="OpenAI-compatible HTTP server for looped language models",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_cli_args(parser)
    from loopserve.errors import UsageError

    try:
        return main_from_args(parser.parse_args(argv))
    except UsageError as err:
        parser.error(str(err))  # usage, "error: ...", exit status 2, as `loopserve serve`
        raise


if __name__ == "__main__":
    raise SystemExit(main())

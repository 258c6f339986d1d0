"""`python -m braid.launch_server` (and `braid serve`): parse ServerArgs from the command line and serve."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional, Sequence

from braid.runtime.config import ServerArgs
from braid.runtime.sglang_flags import add_sglang_flags, check_sglang_flags

logger = logging.getLogger(__name__)


def build_parser(prog: str = "braid.launch_server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP (native + OpenAI API)",
                                     epilog="SGLang v0.3's flags are accepted under their names too; those braid has "
                                            "no use for are answered with what to use instead "
                                            "(runtime/sglang_flags.py).")
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="the model, as with --model-path (vLLM's `serve MODEL` form)")
    ServerArgs.add_cli_args(parser)
    add_sglang_flags(parser)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = "braid.launch_server") -> ServerArgs:
    return parse_args_and_notices(argv, prog)[0]


def parse_args_and_notices(argv: Optional[Sequence[str]] = None,
                           prog: str = "braid.launch_server") -> tuple[ServerArgs, list[str]]:
    """(the ServerArgs, one line per SGLang flag given that has no effect in braid)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    notices, errors = check_sglang_flags(args)
    if errors:
        parser.exit(2, "".join(f"{parser.prog}: error: {e}\n" for e in errors))
    default_model_path = ServerArgs.model_path
    if args.model is not None:
        if args.model_path not in (default_model_path, args.model):
            parser.exit(2, f"{parser.prog}: error: two models given: {args.model} and --model-path "
                           f"{args.model_path}; give one\n")
        args.model_path = args.model
    try:
        return ServerArgs.from_cli_args(args), notices
    except ValueError as e:  # one line, without argparse's usage text for every flag
        parser.exit(2, f"{parser.prog}: error: {e}\n")


# import name -> distribution of the `runtime` extra (pyproject.toml) that serving imports
RUNTIME_PACKAGES = {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors", "gguf": "gguf",
                    "outlines_core": "outlines-core", "zmq": "pyzmq", "msgspec": "msgspec",
                    "prometheus_client": "prometheus-client"}


def configure_logging(server_args: ServerArgs) -> None:
    """The root logger as launch_server sets it (its own basicConfig is then a no-op), so lines logged before it
    runs look the same."""
    logging.basicConfig(level=getattr(logging, server_args.log_level.upper()),
                        format="[server %(asctime)s] %(levelname)s %(message)s")


def missing_runtime_packages() -> list[str]:
    missing = []
    for module, distribution in RUNTIME_PACKAGES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(distribution)
    return missing


def main(argv: Optional[Sequence[str]] = None, prog: str = "braid.launch_server") -> int:
    server_args, notices = parse_args_and_notices(sys.argv[1:] if argv is None else argv, prog)
    missing = missing_runtime_packages()
    if missing:
        print(f"braid: serving needs the runtime extra, and {', '.join(missing)} "
              f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'braid[runtime]'", file=sys.stderr)
        return 2
    from braid.runtime.server.startup import StartRefused, launch_server
    from braid.runtime.server.tokenizer_manager import SchedulerStartError

    configure_logging(server_args)
    for notice in notices:
        logger.info(notice)
    try:
        return launch_server(server_args)
    except (StartRefused, SchedulerStartError) as e:
        print(f"braid: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. the port is taken
        print(f"braid: cannot serve on {server_args.host}:{server_args.port}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

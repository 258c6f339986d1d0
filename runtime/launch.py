"""`python -m braid.launch_server`: parse ServerArgs from the command line and serve."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from braid.runtime.config import ServerArgs


def parse_args(argv: Optional[Sequence[str]] = None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="braid.launch_server", description="Serve a model over HTTP (native + OpenAI API)")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        return ServerArgs.from_cli_args(args)
    except ValueError as e:  # one line, without argparse's usage text for every flag
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from braid.runtime.server.http_server import launch_server
    from braid.runtime.server.tokenizer_manager import SchedulerStartError

    server_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return launch_server(server_args)
    except SchedulerStartError as e:
        print(f"braid: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. the port is taken
        print(f"braid: cannot serve on {server_args.host}:{server_args.port}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

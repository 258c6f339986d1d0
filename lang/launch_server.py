"""`python -m braid.launch_server --model-path ... --port ...`: serve a model (see braid.runtime.launch)."""

import sys

from braid.runtime.launch import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())

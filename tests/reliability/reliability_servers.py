"""Real SmolLM2 servers with reliability-sized limits (the folder's tests import these by this module's name; the
fixtures are conftest.py's)."""

import time

import real_server
from real_server import Server

API_KEY = "reliability-key"
BASE_FLAGS = ["--max-total-tokens", "8192", "--log-level", "warning"]


class ReliabilityServer(Server):
    def scheduler_pid(self) -> int:
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return int(f.read().split()[0])

    def idle_stats(self, timeout_s: float = 60) -> dict:
        """/get_server_info once no request is in flight."""
        deadline = time.time() + timeout_s
        while True:
            info = self.get("/get_server_info").json()
            idle = info["num_server_requests"] == 0 and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
            if idle or time.time() > deadline:
                return info
            time.sleep(0.2)


def start_server(*flags: str, env: dict | None = None, api_key: str = API_KEY) -> ReliabilityServer:
    # the API key comes from the environment: it must work without --api-key on the command line
    return real_server.start_server([*BASE_FLAGS, *flags], api_key, "braid-reliability-",
                                    env={"BRAID_API_KEY": api_key, **(env or {})}, server_cls=ReliabilityServer)


MAX_PROMPT_CHARS = 3_000_000
MAX_BODY_BYTES = 4 << 20
MAX_RUNNING, MAX_QUEUED = 2, 1
GRAMMAR_TIMEOUT_S = 4

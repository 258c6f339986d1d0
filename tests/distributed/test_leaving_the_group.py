"""Two gloo ranks that end the way the scheduler's ranks do: rank 0 broadcasts the stop step and both leave
(`leave_tensor_parallel`). A process exiting with its gloo group still open can abort in teardown ("terminate called
without an active exception"; about one exit in three on this 2-core machine), which is how a follower once exited
non-zero after node 0 stopped."""

import os
import subprocess
import sys

from braid.runtime.processes.tensor_parallel import free_loopback_addr

RANK_PROGRAM = """
import sys, torch
from braid.runtime.distributed import parallel_state as ps
rank, addr = int(sys.argv[1]), sys.argv[2]
ps.init_tensor_parallel(2, rank, addr, torch.device("cpu"))
for step in range(20):
    got = ps.broadcast_bytes(b"step %d" % step if rank == 0 else None)
    assert got == b"step %d" % step, got
ps.leave_tensor_parallel()
assert not ps.is_initialized()
"""


def test_both_ranks_exit_cleanly_after_leaving():
    for _ in range(8):
        addr = free_loopback_addr()
        ranks = [subprocess.Popen([sys.executable, "-c", RANK_PROGRAM, str(rank), addr], stderr=subprocess.PIPE,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
                 for rank in (0, 1)]
        outcomes = [(proc.wait(60), proc.stderr.read().decode()[-2000:]) for proc in ranks]
        assert [code for code, _ in outcomes] == [0, 0], outcomes

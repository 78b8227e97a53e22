"""A faster way for numba's CUDA simulator to run a block, installed by tests/conftest.py.

The simulator starts a Python thread for every CUDA thread of every block (about 0.5 ms each on CI's two
cores: a decode step's 16-block matmul spent more time starting threads than computing), and its block
manager polls every thread in a loop, holding the GIL, until all of them wait at syncthreads. Here each block
size has one pool of threads that runs block after block, launch after launch, and a block's threads meet at
syncthreads on a condition variable (a thread that has returned no longer counts, as in the simulator).
Blocks still run one at a time, in grid order, so kernels compute exactly what the simulator computes.
"""

import threading

import numpy as np
from numba.cuda.simulator import kernel as simulator


class _Pool:
    """Worker threads for blocks of one shape; run() gives them a block and returns when all have returned."""

    def __init__(self, block_dim):
        self._block_dim = block_dim            # the name BlockThread reads from its manager
        self.lock = threading.Lock()           # one block at a time, whichever thread launches it
        self.cond = threading.Condition()
        self.block = 0                         # blocks handed out so far
        self.work = None                       # (manager, grid point, args) of the current block
        self.running = self.waiting = 0        # threads in the block, and those of them at syncthreads
        self.sync = 0                          # syncthreads released so far
        self.abort = False
        self.threads = [_Worker(self, index) for index in np.ndindex(*block_dim)]
        for thread in self.threads:
            thread.start()

    def run(self, manager, grid_point, args):
        with self.lock, self.cond:
            for thread in self.threads:
                thread.blockIdx, thread._manager, thread.exception = simulator.Dim3(*grid_point), manager, None
            self.work, self.abort = (manager, args), False
            self.running, self.waiting = len(self.threads), 0
            self.block += 1
            self.cond.notify_all()
            while self.running:
                self.cond.wait()
            failed = [t.exception for t in self.threads if t.exception and not isinstance(t.exception[0], _Aborted)]
            if failed:
                raise failed[0][0].with_traceback(failed[0][1])

    def syncthreads(self):
        with self.cond:
            if self.abort:
                raise _Aborted("abort flag set on syncthreads call")
            self.waiting += 1
            sync = self.sync
            self._release()
            while self.sync == sync and not self.abort:
                self.cond.wait()
            if self.abort:
                raise _Aborted("abort flag set on syncthreads clear")

    def _release(self):
        """Lets the threads at syncthreads go once every thread still running is there."""
        if self.waiting and self.waiting == self.running:
            self.waiting = 0
            self.sync += 1
            self.cond.notify_all()

    def returned(self, failed: bool):
        with self.cond:
            self.running -= 1
            self.abort = self.abort or failed
            if failed or not self.running:
                self.cond.notify_all()
            else:
                self._release()


class _Aborted(RuntimeError):
    """What the other threads of a block raise at syncthreads once one of them has failed."""


class _Worker(simulator.BlockThread):
    def __init__(self, pool, thread_index):
        super().__init__(None, pool, (0, 0, 0), thread_index, False)
        self.pool = pool

    def run(self):
        block = 0
        while True:
            with self.pool.cond:
                while self.pool.block == block:
                    self.pool.cond.wait()
                block = self.pool.block
                manager, args = self.pool.work
            try:
                manager._f(*args)
            except Exception as e:
                message = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}" + (f": {e}" if str(e) else "")
                self.exception = (type(e)(message), e.__traceback__)
            self.pool.returned(self.exception is not None)

    def syncthreads(self):
        self.pool.syncthreads()


_pools = {}


def _run_block(manager, grid_point, *args):
    pool = _pools.get(manager._block_dim)
    if pool is None:
        pool = _pools[manager._block_dim] = _Pool(manager._block_dim)
    pool.run(manager, grid_point, args)


def install():
    simulator.BlockManager.run = _run_block

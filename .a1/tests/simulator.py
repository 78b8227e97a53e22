"""A faster way for numba's CUDA simulator to run a block, installed by tests/conftest.py.

The simulator starts an OS thread for every CUDA thread of every block, and its block manager polls them, holding
the GIL, until all wait at syncthreads; every barrier then wakes each thread through the kernel (on CI's two
cores most of a simulated test's time went to starting, waking and switching threads, not to computing). Here a
block's threads are greenlets on the launching thread: each runs until it reaches syncthreads or returns, then
hands over to the next, in thread order; once every thread still running waits at the barrier, they go on (a
thread that has returned no longer counts, as in the simulator). A switch is no system call, and a kernel with
no barrier runs its threads one after another. Blocks run one at a time, in grid
order, so kernels compute exactly what the simulator computes.

greenlet is a test dependency only: Python has no other way to suspend a function in the middle of its frame
without rewriting it as a generator (the kernels are the production code, written for numba.cuda).
"""

import threading

import numpy as np
from greenlet import getcurrent, greenlet
from numba.cuda.simulator import kernel as simulator

_BARRIERS_UNSUPPORTED = ("syncthreads_count", "syncthreads_and", "syncthreads_or")
_THREAD_STATE = ("blockIdx", "threadIdx", "thread_id", "_manager", "syncthreads") + _BARRIERS_UNSUPPORTED


def _syncthreads():
    """A thread's barrier: back to its block's scheduler, which resumes it once every running thread is here."""
    getcurrent().parent.switch()


def _unsupported(*_args):
    raise NotImplementedError("tests/simulator.py runs syncthreads only; no kernel of this project uses "
                              "syncthreads_count, _and or _or")


def _run_block(manager, grid_point, *args):
    thread = threading.current_thread()
    saved = {name: thread.__dict__[name] for name in _THREAD_STATE if name in thread.__dict__}
    block_dim = simulator.Dim3(*manager._block_dim)
    indices = [simulator.Dim3(*index) for index in np.ndindex(*manager._block_dim)]
    thread.blockIdx, thread._manager, thread.syncthreads = simulator.Dim3(*grid_point), manager, _syncthreads
    for name in _BARRIERS_UNSUPPORTED:
        setattr(thread, name, _unsupported)
    scheduler = getcurrent()
    running = [greenlet(lambda: manager._f(*args), parent=scheduler) for _ in indices]
    try:
        while running:          # each pass runs every thread up to the next barrier, or to its end
            for index, lane in zip(indices, running):
                thread.threadIdx = index
                thread.thread_id = index.x + block_dim.x * (index.y + block_dim.y * index.z)
                try:
                    lane.switch()
                except Exception as e:
                    message = f"tid={list(index)} ctaid={list(grid_point)}" + (f": {e}" if str(e) else "")
                    raise type(e)(message).with_traceback(e.__traceback__) from None
            alive = [i for i, lane in enumerate(running) if not lane.dead]
            indices, running = [indices[i] for i in alive], [running[i] for i in alive]
    finally:
        for name in _THREAD_STATE:
            thread.__dict__.pop(name, None)
        thread.__dict__.update(saved)


def install():
    simulator.BlockManager.run = _run_block

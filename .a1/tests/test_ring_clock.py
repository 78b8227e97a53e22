"""The prefill ring's host clocks (`runtime.ring_clock`) and the calibration's fit of them."""

import numpy as np
import pytest

from runtime.calibration_fit import fit_ring_host
from runtime.engine import Engine
from runtime.ring_clock import BlockClock, RingClock
from tests.test_engine import folder, model, plan_for  # noqa: F401  (fixtures)


def test_the_fit_recovers_a_blocks_routing_and_a_batchs_calls(rng):
    """Blocks of 1 to 12 batches whose host time beyond their copies and launches is routing + batches x rest:
    both come back, and a copy's time is the driver copies' mean."""
    routing_s, rest_s, copy_s = rng.uniform(50e-6, 300e-6), rng.uniform(5e-6, 40e-6), rng.uniform(3e-6, 20e-6)
    blocks = []
    for n_batches in rng.integers(1, 13, size=10):
        launches = rng.uniform(30e-6, 70e-6, size=n_batches).tolist()
        copies = rng.integers(1, 6, size=n_batches * 2)
        copy_times = (copies * 2 * copy_s).tolist()        # each `_copy_in` made two driver copies
        sync_s = rng.uniform(0, routing_s)
        block = BlockClock(0, sync_s, copy_s=copy_times, driver_copies=int(copies.sum() * 2), batch_s=launches)
        block.issue_s = sum(copy_times) + sum(launches) + routing_s - sync_s + n_batches * rest_s
        blocks.append(block)
    fits = fit_ring_host(blocks)
    launch_s = sum(sum(b.batch_s) for b in blocks) / sum(len(b.batch_s) for b in blocks)
    assert fits["prefill_ring_copy"].latency_s == pytest.approx(copy_s)
    assert fits["prefill_ring_block"].latency_s == pytest.approx(routing_s)
    assert fits["prefill_ring_call"].latency_s == pytest.approx(launch_s + rest_s)
    with pytest.raises(RuntimeError, match="streamed no experts"):
        fit_ring_host([])


def test_the_clock_sees_every_streaming_block_and_puts_the_engine_back(folder, model, rng):  # noqa: F811
    """Half the experts cached and a ring of 2 slots: every batch streams one expert, its three matrices a
    `_copy_in` each, and a `_copy_in` is a driver copy of its data (and one of its scales, for a quantized type).
    The engine's tokens and logits are unchanged, and its own calls are back once the clock closes."""
    plan = plan_for(folder, model, 600, ring_slots=2)
    assert plan.knobs["expert_cache_slots"][0] == 4
    prompt = rng.integers(0, 128, size=7).tolist()
    with Engine(plan, model, progress=False, kv_lending=False) as engine:
        plain = engine.generate(prompt, max_new_tokens=1, return_logits=True)
        own = (engine.experts.stream_block, engine.experts._copy_in, engine.compute.synchronize)
        with RingClock(engine) as clock:
            clock.begin()
            clocked = engine.generate(prompt, max_new_tokens=1, return_logits=True)
            blocks = clock.end()
        assert (engine.experts.stream_block, engine.experts._copy_in, engine.compute.synchronize) == own
        scales = next(iter(engine.experts.host_arrays.values()))[1]
    assert clocked.tokens == plain.tokens and np.array_equal(clocked.logits, plain.logits)
    assert [b.block for b in blocks] == [0]
    block = blocks[0]
    assert len(block.batch_s) >= 1 and len(block.copy_s) == 3 * len(block.batch_s)
    assert block.driver_copies == (1 if scales is None else 2) * len(block.copy_s)
    assert block.issue_s >= sum(block.copy_s) + sum(block.batch_s) and block.rest_s >= 0

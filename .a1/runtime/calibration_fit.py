"""The calibration's fits, without a GPU: a family's latency and efficiency from its timed nodes (`fit`), a
tiled family's tile model (`fit_tiled`), prefill attention's walk (`fit_walk`), the prefill ring's host calls
(`fit_ring_host`), and what a fitted family prices a node at (`sample_s`). `runtime.calibrate` times the nodes
on the GPU (`Sample`s, which `stratum profile --detect --samples` also writes); these turn them into the
profile's `kernels:` block, and can redo that from the samples' JSON.
"""

import itertools
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from codegen.cost import fitted_s, tiled_sm_s
from planner.profile import TILED_FAMILIES, WALK_FAMILIES, KernelFit, Kernels

FURTHER_TILE_GRID = np.linspace(0.5, 1.0, 51)   # the further-tile fractions `fit_tiled` tries
WALK_GRID = 401            # points a side of `fit_walk`'s grid
WALK_MIN_CONTEXTS = 3      # distinct contexts a walk needs besides a latency and an efficiency


class Sample(NamedTuple):
    """One timed node of the calibration."""
    family: str
    node: str
    roofline_s: float
    measured_s: float
    tiles: tuple | None = None      # a tiled family's: (waves, a tile's FLOPs at an SM's peak s, its weight
    #                                 elements), `codegen.cost.tile_terms`
    context_tokens: int = 0         # the positions of K/V its pass's last row reads (a prefill attention walk)


def fit(rooflines_s, times_s) -> KernelFit:
    """The latency and efficiency of latency + roofline / efficiency that fit the measured times in least
    squares, with latency >= 0 and efficiency in (0, 1]. Absolute, not relative, errors: with its intercept
    the fit then gives the family's nodes their measured total (so does each constrained fallback), which is
    what a pass's prediction adds up; a relative fit let a family's many small nodes pull the large ones'
    times down (the calibration model's own prompts priced 13-14% under their measured wall, BENCHMARKS.md)."""
    roof, measured = np.asarray(rooflines_s, float), np.asarray(times_s, float)
    latency, inverse = np.linalg.lstsq(np.column_stack([np.ones_like(roof), roof]), measured, rcond=None)[0]
    if inverse < 1.0:          # no faster than the roofline: efficiency 1, the rest is latency
        inverse = 1.0
        latency = float(np.mean(measured - roof))
    if latency < 0:            # no negative latency: the roofline scaled alone, to the measured total
        latency = 0.0
        inverse = max(1.0, float(np.sum(measured) / np.sum(roof)))
    return KernelFit(efficiency=float(1.0 / inverse), latency_s=float(max(latency, 0.0)))


def fit_walk(rooflines_s, contexts, times_s) -> KernelFit:
    """`fit` with a walk (`KernelFit.walk_token_s`): the latency >= 0, efficiency in (0, 1] and walk_token_s
    >= 0 of latency + max(roofline / efficiency, walk_token_s x context) that fit the measured times in least
    squares (absolute errors, as `fit`). The max makes it piecewise: searched on a grid of walks and inverse
    efficiencies, refined twice around the best, the latency solved at each point (the mean residual, held at
    0 below it), then polished by least squares on the best point's split into walk-bound and FLOP-bound nodes
    while the split holds. Fewer than WALK_MIN_CONTEXTS distinct contexts cannot tell a walk from a latency and an
    efficiency: `fit` alone."""
    roof, context, measured = (np.asarray(column, float) for column in (rooflines_s, contexts, times_s))
    if len(set(context.tolist())) < WALK_MIN_CONTEXTS:
        return fit(roof, measured)

    def error(walk, inverse):
        bound = np.maximum(roof[None, None] * inverse[None, :, None], walk[:, None, None] * context[None, None])
        latency = np.maximum(0.0, np.mean(measured - bound, axis=-1))
        return np.sum((measured - bound - latency[..., None]) ** 2, axis=-1), latency

    walks = np.linspace(0.0, float(np.max(measured / np.maximum(context, 1.0))), WALK_GRID)
    inverses = np.geomspace(1.0, max(2.0, float(np.max(measured / np.maximum(roof, 1e-15)))), WALK_GRID)
    for _ in range(3):
        sse, latency = error(walks, inverses)
        i, j = np.unravel_index(np.argmin(sse), sse.shape)
        best = (walks[i], inverses[j], latency[i, j])
        walks = np.linspace(walks[max(i - 1, 0)], walks[min(i + 1, len(walks) - 1)], WALK_GRID)
        inverses = np.geomspace(inverses[max(j - 1, 0)], inverses[min(j + 1, len(inverses) - 1)], WALK_GRID)
    walk, inverse, latency = best
    for _ in range(3):      # polish: the grid's split into walk-bound and FLOP-bound nodes, solved exactly
        walked = walk * context > roof * inverse
        if walked.all() or not walked.any():
            break           # one kind alone leaves a column of zeros: the grid's point stands
        design = np.column_stack([np.ones_like(roof), np.where(walked, 0.0, roof), np.where(walked, context, 0.0)])
        solved = _bounded_lstsq(design, measured, [0.0, 1.0, 0.0], [np.inf, np.inf, np.inf])[0]
        if not np.array_equal(solved[2] * context > roof * solved[1], walked) or \
                error(solved[2:], solved[1:2])[0][0, 0] >= error(np.array([walk]), np.array([inverse]))[0][0, 0]:
            break
        latency, inverse, walk = solved
    return KernelFit(efficiency=float(1.0 / inverse), latency_s=float(latency), walk_token_s=float(walk))


def fit_tiled(tiles, times_s, weight_element_s: float | None = None) -> KernelFit:
    """The `codegen.cost.tiled_s` model fitted to nodes of `tiles` ((waves, a tile's FLOPs at an SM's peak s,
    its weight elements) each) and measured `times_s`: least squares over latency >= 0, efficiency in (0, 1]
    and weight_element_s >= 0 (or the one given: a family whose tiles are all one shape cannot tell it from
    its efficiency), at the best further-tile fraction of FURTHER_TILE_GRID."""
    waves, peak_s, weights = (np.asarray(column, float) for column in zip(*tiles))
    measured = np.asarray(times_s, float)
    best = None
    for further in FURTHER_TILE_GRID:
        sm_tiles = 1.0 + further * (waves - 1.0)
        columns = [np.ones_like(measured), sm_tiles * peak_s, sm_tiles * weights]
        lower, upper = [0.0, 1.0, 0.0], [np.inf, np.inf, np.inf]
        if weight_element_s is not None:
            lower[2] = upper[2] = weight_element_s
        coef, sse = _bounded_lstsq(np.column_stack(columns), measured, lower, upper)
        if best is None or sse < best[0]:
            best = (sse, further, coef)
    _, further, (latency, inverse, weight_element) = best
    return KernelFit(efficiency=float(1.0 / inverse), latency_s=float(latency),
                     weight_element_s=float(weight_element), further_tile=float(further))


def _bounded_lstsq(design, measured, lower, upper):
    """(coefficients, squared error) of least squares with each coefficient within [lower, upper]: the best
    of every choice of coefficients held at a bound and the rest solved freely (exact for a few columns). A
    coefficient whose bounds are equal (a given value) is always held: solved freely it could land within the
    feasibility slack of its value, not on it."""
    best = None
    choices = [[lo] if lo == hi else [None] + sorted({lo, hi} - {np.inf}) for lo, hi in zip(lower, upper)]
    for held in itertools.product(*choices):
        coef = np.array([0.0 if h is None else h for h in held])
        free = [i for i, h in enumerate(held) if h is None]
        if free:
            rest = measured - design @ coef
            norms = np.linalg.norm(design[:, free], axis=0)      # columns of seconds, 1 and elements: scaled
            coef[free] = np.linalg.lstsq(design[:, free] / norms, rest, rcond=None)[0] / norms
        if np.any(coef < np.asarray(lower) - 1e-15) or np.any(coef > np.asarray(upper) + 1e-15):
            continue
        sse = float(np.sum((design @ coef - measured) ** 2))
        if best is None or sse < best[1]:
            best = (coef, sse)
    return best         # never None: every coefficient held at a finite bound is feasible


def fit_families(samples: list) -> dict:
    """family -> its fit, for each family the samples time: the tiled ones by `fit_tiled` (the routed experts
    with their pass's matmuls' weight_element_s: the same prefill core, tiles of one shape), the rest by `fit`."""
    grouped = defaultdict(list)
    for sample in samples:
        grouped[sample.family].append(sample)
    fits = {}
    for family in sorted(grouped, key=lambda f: not f.endswith("_matmul")):     # the matmuls first
        rows = grouped[family]
        if family in TILED_FAMILIES:
            matmul = family.replace("_experts", "_matmul")
            given = fits[matmul].weight_element_s if family != matmul and matmul in fits else None
            fits[family] = fit_tiled([r.tiles for r in rows], [r.measured_s for r in rows], given)
        elif family in WALK_FAMILIES:
            fits[family] = fit_walk([r.roofline_s for r in rows], [r.context_tokens for r in rows],
                                    [r.measured_s for r in rows])
        else:
            fits[family] = fit([r.roofline_s for r in rows], [r.measured_s for r in rows])
    return fits


def sample_s(kernels: Kernels, sample: Sample) -> float:
    """What the fitted `kernels` price a sample at."""
    family = getattr(kernels, sample.family)
    if sample.tiles is not None:
        return family.latency_s + float(tiled_sm_s(family, *sample.tiles))
    return float(fitted_s(family, sample.roofline_s, sample.context_tokens))


def fit_ring_host(blocks: list) -> dict:
    """The prefill ring's host families from `runtime.ring_clock.BlockClock`s: a driver copy's mean host time;
    each block's host time beyond its copies and launches (its routing's wait and work, and the rest of each
    batch: events, tables, Python) fitted as a per-block `prefill_ring_block` plus a per-batch part (bounded
    least squares: both at least 0), which `prefill_ring_call` adds to a batch's mean launch time."""
    if not blocks:
        raise RuntimeError("the ring calibration's plans streamed no experts")
    copy_s = sum(sum(b.copy_s) for b in blocks) / max(1, sum(b.driver_copies for b in blocks))
    batches = np.array([len(b.batch_s) for b in blocks], float)
    launch_s = sum(sum(b.batch_s) for b in blocks) / batches.sum()
    beyond = np.array([b.rest_s + b.sync_s for b in blocks])
    (block_s, per_batch_s), _ = _bounded_lstsq(np.stack([np.ones_like(batches), batches], axis=1), beyond,
                                               [0.0, 0.0], [np.inf, np.inf])
    return {"prefill_ring_copy": KernelFit(latency_s=float(copy_s)),
            "prefill_ring_call": KernelFit(latency_s=float(launch_s + per_batch_s)),
            "prefill_ring_block": KernelFit(latency_s=float(block_s))}

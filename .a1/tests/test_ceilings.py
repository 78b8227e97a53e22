"""runtime.ceilings' pointer chase: one random cycle through every line, followed one dependent load a hop."""

import numpy as np

from codegen.lower.cuda import cuda
from runtime import ceilings


def test_the_chase_visits_every_line_once_before_it_returns():
    lines = 16
    words = ceilings._chase_cycle(lines * ceilings.LINE_WORDS)
    starts = np.arange(lines) * ceilings.LINE_WORDS
    seen, i = [], 0
    for _ in range(lines):
        seen.append(i)
        i = int(words[i])
    assert i == 0 and sorted(seen) == list(starts)
    assert not np.any(np.delete(words, starts))         # only a line's first word points anywhere

    next_word, at = cuda.to_device(words), cuda.to_device(np.zeros(1, np.int32))
    ceilings._chase_kernel[1, 1](next_word, 5, at)      # the kernel follows the same cycle, and goes on from there
    ceilings._chase_kernel[1, 1](next_word, 3, at)
    assert at.copy_to_host()[0] == seen[8]

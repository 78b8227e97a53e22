"""runtime.decode_rates: each type's decode read rate against Q8_0's, as `stratum profile --detect` writes it and
the profile reads it back. The simulator has no event timer: the timing is replaced by one that runs every
launch once and says each took the same time, so a type's rate must be its bytes' share of Q8_0's."""

import pytest
import yaml
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from codegen.lower.cuda import cuda
from planner.profile import load_profile
from runtime import decode_rates
from tests.test_profile import variant, write


def test_a_type_read_in_q8_0s_time_has_its_bytes_share_of_the_rate_and_reads_back(rng, tmp_path, monkeypatch):
    launched = []

    def same_time(enqueues, replays):
        stream = cuda.stream()
        for enqueue in enqueues:
            enqueue(stream)
            launched.append(enqueue)
        stream.synchronize()
        return 1e-3

    monkeypatch.setattr(decode_rates, "graph_seconds", same_time)
    notes = []
    rates = decode_rates.decode_weight_rates(rng, types=(T.Q4_K, T.F16), shape=(8, 256), note=notes.append,
                                             launches=1, copies=1)
    per_value = {t: GGML_QUANT_SIZES[t][1] / GGML_QUANT_SIZES[t][0] for t in (T.Q8_0, T.Q4_K, T.F16)}
    assert rates == {"Q4_K": float(f"{per_value[T.Q4_K] / per_value[T.Q8_0]:.3g}"),
                     "F16": float(f"{per_value[T.F16] / per_value[T.Q8_0]:.3g}")}
    assert len(launched) == 3 and len(notes) == 3 and "Q8_0 read at" in notes[0]
    path = write(tmp_path, yaml.safe_load(yaml.safe_dump(variant(decode_weight_rates=rates))))
    assert load_profile(path).gpus[0].decode_weight_rate("Q4_K") == pytest.approx(rates["Q4_K"])

# The default dtype: bf16 on CUDA; on a CPU ruled out without native bf16, else measured once and cached.
import json

import pytest
import torch

import dtypes


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path))
    monkeypatch.setattr(dtypes, "native_bf16", lambda: True)
    return tmp_path / dtypes.CACHE


def test_cuda_is_bf16_without_measuring(cache, monkeypatch):
    monkeypatch.setattr(dtypes, "measure_cpu", lambda: pytest.fail("CUDA must not measure"))
    assert dtypes.default_dtype("cuda") == torch.bfloat16 and not cache.exists()


def test_cpu_without_native_bf16_is_fp32_without_measuring(cache, monkeypatch):
    monkeypatch.setattr(dtypes, "native_bf16", lambda: False)
    monkeypatch.setattr(dtypes, "measure_cpu", lambda: pytest.fail("ruled out by the capability query"))
    logs = []
    assert dtypes.default_dtype("cpu", log=logs.append) == torch.float32 and logs == []  # nothing measured, nothing to say


@pytest.mark.parametrize("fp32_ms,bf16_ms,choice", [(10.0, 4.0, torch.bfloat16), (10.0, 9.5, torch.float32), (4.0, 10.0, torch.float32)])
def test_cpu_choice_is_measured_once_then_cached(cache, monkeypatch, fp32_ms, bf16_ms, choice):
    monkeypatch.setattr(dtypes, "measure_cpu", lambda: {"float32_ms": fp32_ms, "bfloat16_ms": bf16_ms})
    logs = []
    assert dtypes.default_dtype("cpu", log=logs.append) == choice
    assert str(choice).removeprefix("torch.") in logs[0] and str(cache) in logs[0]
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["choice"] == str(choice).removeprefix("torch.")
    monkeypatch.setattr(dtypes, "measure_cpu", lambda: pytest.fail("the second call must read the cache"))
    assert dtypes.default_dtype("cpu", log=logs.append) == choice and len(logs) == 1  # said once, when measured


def test_measurement_times_both_dtypes():
    ms = dtypes.measure_cpu()
    assert set(ms) == {"float32_ms", "bfloat16_ms"} and all(v > 0 for v in ms.values())


def _slow_then_fast(monkeypatch):
    """_linear_ms as a shared host gives it: a slowed first round (bf16 ahead by less than MIN_GAIN), then the
    machine's real speeds."""
    rounds = iter([[10.32, 9.61], [8.37, 5.93]] + [[8.4, 6.0]] * dtypes.ROUNDS)
    monkeypatch.setattr(dtypes, "_linear_ms", lambda weights, kinds: next(rounds))
    monkeypatch.setattr(dtypes.time, "sleep", lambda s: None)


def test_a_slowed_round_does_not_decide_the_dtype(monkeypatch):
    _slow_then_fast(monkeypatch)
    assert dtypes.measure_cpu() == {"float32_ms": 8.37, "bfloat16_ms": 5.93}
    _slow_then_fast(monkeypatch)  # the rule it replaced: one round decides, and picks fp32 here
    first = dtypes._linear_ms(None, None)
    assert not first[0] > dtypes.MIN_GAIN * first[1]


def test_where_fp32_is_faster_every_round_is_taken(monkeypatch):
    calls = []
    monkeypatch.setattr(dtypes, "_linear_ms", lambda weights, kinds: calls.append(1) or [4.0 + len(calls), 10.0])
    monkeypatch.setattr(dtypes.time, "sleep", lambda s: None)
    assert dtypes.measure_cpu() == {"float32_ms": 5.0, "bfloat16_ms": 10.0} and len(calls) == dtypes.ROUNDS

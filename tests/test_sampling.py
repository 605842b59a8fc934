"""The logits -> probabilities transform shared by target and drafters."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.errors import InvalidParameter
from verispec.sampling import logits_to_probs
from verispec.types import SamplingParams


def test_temperature_only_is_softmax_of_scaled_logits():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    got = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(got, torch.softmax(logits / 0.5, -1))


def test_greedy_is_one_hot_at_argmax():
    got = logits_to_probs(torch.tensor([0.1, 3.0, 2.9]), SamplingParams())
    assert got.tolist() == [0.0, 1.0, 0.0]


def test_top_k_keeps_k_largest():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    got = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    expect = torch.zeros(5)
    expect[[1, 2]] = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    assert torch.allclose(got, expect)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    got = logits_to_probs(probs.log(), SamplingParams(temperature=1.0, top_p=0.8))
    # 0.5 < 0.8, 0.5 + 0.3 = 0.8 reaches it: keep the first two
    assert torch.allclose(got, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    got = logits_to_probs(probs.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(got, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_top_k_keeps_every_token_tied_at_the_kth_value():
    got = logits_to_probs(torch.tensor([0.0, 0.0, 1.0, -1.0]), SamplingParams(temperature=1.0, top_k=2))
    assert (got > 0).tolist() == [True, True, True, False]


def test_top_p_always_keeps_the_top_token():
    got = logits_to_probs(torch.tensor([5.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_p=0.01))
    assert got.tolist() == [1.0, 0.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=12), st.floats(0.05, 3.0), st.integers(0, 12), st.floats(0.01, 1.0))
def test_transform_is_a_distribution_on_a_subset_of_the_support(values, temperature, top_k, top_p):
    logits = torch.tensor(values)
    p = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-5)
    assert (p >= 0).all()
    assert p[logits.argmax()] > 0  # the most likely token survives every filter
    if 0 < top_k:  # at most the tokens tied with or above the k-th largest (ties at the k-th are all kept,
        # as transformers' top-k does: [0, 0, 1] with k = 2 keeps all three)
        scaled = logits / temperature
        kth = torch.topk(scaled, min(top_k, len(values))).values[-1]
        assert int((p > 0).sum()) <= int((scaled >= kth).sum())


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(max_new_tokens=0)])
def test_invalid_parameters_raise_typed_errors(kw):
    with pytest.raises(InvalidParameter):
        SamplingParams(**kw)

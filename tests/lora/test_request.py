"""LoRARequest: the adapter id must be a positive integer (it is the scheduler's prefix-cache
namespace; 0 is the base model's); requests are frozen values."""

from __future__ import annotations

import dataclasses

import pytest

from pyserve.lora.request import LoRARequest


@pytest.mark.parametrize("lora_int_id", [0, -3, 1.0, "1", None])
def test_an_id_that_is_not_a_positive_integer_is_refused_naming_the_field(lora_int_id):
    with pytest.raises(ValueError, match=r"^lora_request\.lora_int_id must be a positive integer"):
        LoRARequest("a", lora_int_id, "/adapters/a")


def test_requests_are_frozen_values():
    a = LoRARequest("a", 1, "/adapters/a")
    assert a == LoRARequest("a", 1, "/adapters/a") and hash(a) == hash(LoRARequest("a", 1, "/adapters/a"))
    assert a != LoRARequest("a", 2, "/adapters/a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.lora_int_id = 2

"""Block hashes are chained, deterministic across processes, and cover only full blocks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine.contracts.block_hash import hash_block_tokens, hash_prompt_blocks


@pytest.mark.parametrize(("num_tokens", "block_size", "num_hashes"), [
    (0, 4, 0), (3, 4, 0), (4, 4, 1), (9, 4, 2), (32, 16, 2), (33, 16, 2),
])
def test_only_full_blocks_are_hashed(num_tokens, block_size, num_hashes):
    assert len(hash_prompt_blocks(list(range(num_tokens)), block_size)) == num_hashes


def test_hash_is_chained_over_the_parent():
    a = hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_prompt_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different prefix
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])


def test_hash_is_the_same_in_another_process():
    code = ("from kvpilot.engine.contracts.block_hash import hash_prompt_blocks;"
            "print(hash_prompt_blocks(list(range(40)), 16))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "123"})
    assert other.stdout.strip() == str(hash_prompt_blocks(list(range(40)), 16))


@given(st.lists(st.integers(0, 2**31 - 1), min_size=8, max_size=8),
       st.lists(st.integers(0, 2**31 - 1), min_size=8, max_size=8))
def test_different_blocks_get_different_hashes(x, y):
    if x != y:
        assert hash_prompt_blocks(x, 8) != hash_prompt_blocks(y, 8)


def test_fleets_with_different_secrets_hash_the_same_prompt_differently():
    from kvpilot.engine.contracts.fleet_secret import FleetSecret

    prompt = list(range(64))
    a, b = FleetSecret(b"a" * 32), FleetSecret(b"b" * 32)
    plain = hash_prompt_blocks(prompt, 16)
    salted_a = hash_prompt_blocks(prompt, 16, salt=a.block_hash_salt)
    salted_b = hash_prompt_blocks(prompt, 16, salt=b.block_hash_salt)
    assert len({*plain, *salted_a, *salted_b}) == 12  # no block shares a hash across fleets
    assert salted_a == hash_prompt_blocks(prompt, 16, salt=FleetSecret(b"a" * 32).block_hash_salt)
    assert FleetSecret().block_hash_salt == b""  # no secret: the unsalted hashes of before
    assert plain[0] == hash_block_tokens(None, prompt[:16])

"""Block hashes: chained, unambiguous, and the same in every process."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.kv.hashing as hashing
from kvtier.kv.hashing import (
    BLOCK_HASH_NUM_BYTES,
    ChainMemo,
    extend_block_hashes,
    hash_block,
    hash_full_blocks,
    root_hash,
)

ROOT = root_hash(("model-fingerprint-abc",))


def test_hashes_are_32_byte_digests() -> None:
    assert len(ROOT) == BLOCK_HASH_NUM_BYTES
    assert len(hash_block(ROOT, [1, 2, 3])) == BLOCK_HASH_NUM_BYTES


def test_cache_salt_starts_a_different_chain() -> None:
    tenant_a = root_hash(("fp", "salt-a"))
    tenant_b = root_hash(("fp", "salt-b"))
    assert tenant_a != tenant_b
    assert hash_block(tenant_a, [5, 6, 7, 8]) != hash_block(tenant_b, [5, 6, 7, 8])
    assert root_hash(("fp", "salt-a")) == tenant_a  # deterministic within the process too


def test_extra_keys_encoding_is_unambiguous() -> None:
    roots = [
        root_hash(()),
        root_hash(("",)),
        root_hash(("ab",)),
        root_hash(("a", "b")),
        root_hash(("b", "a")),
        root_hash((b"ab",)),
        root_hash((1,)),
        root_hash(("1",)),
        root_hash((True,)),
        root_hash((12,)),
        root_hash((1, 2)),
    ]
    assert len(set(roots)) == len(roots)


def test_unsupported_extra_key_type_is_rejected() -> None:
    with pytest.raises(TypeError):
        root_hash((1.5,))  # type: ignore[arg-type]


def test_token_encoding_is_unambiguous() -> None:
    # [1, 2] vs [258] (same bytes if packed as uint8 pairs), [] vs [0], negatives vs large values.
    hashes = {hash_block(ROOT, tokens) for tokens in ([1, 2], [258], [], [0], [-1], [2**63 - 1], [2, 1])}
    assert len(hashes) == 7


def test_parent_changes_the_hash() -> None:
    first = hash_block(ROOT, [1, 2])
    assert hash_block(first, [3, 4]) != hash_block(ROOT, [3, 4])


def test_bad_parent_is_rejected() -> None:
    with pytest.raises(ValueError):
        hash_block(b"short", [1])  # type: ignore[arg-type]


def test_only_full_blocks_are_hashed() -> None:
    assert hash_full_blocks([1, 2, 3], block_size=4, parent=ROOT) == []
    hashes = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4, parent=ROOT)
    assert hashes == [
        hash_block(ROOT, [1, 2, 3, 4]),
        hash_block(hash_block(ROOT, [1, 2, 3, 4]), [5, 6, 7, 8]),
    ]
    # num_tokens limits the hashed prefix without slicing the caller's list.
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, ROOT, num_tokens=7) == hashes[:1]


def test_argument_validation() -> None:
    with pytest.raises(ValueError):
        hash_full_blocks([1, 2], block_size=0, parent=ROOT)
    with pytest.raises(ValueError):
        hash_full_blocks([1, 2], block_size=1, parent=ROOT, start_block=-1)
    with pytest.raises(ValueError):
        hash_full_blocks([1, 2], block_size=1, parent=ROOT, num_tokens=3)


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    block_size=st.integers(1, 8),
)
def test_incremental_extension_equals_hashing_from_scratch(
    tokens: list[int], cuts: list[int], block_size: int
) -> None:
    """A sequence that grows in steps ends with the same chain as one hashed in one go."""
    chain: list = []
    for cut in sorted(min(c, len(tokens)) for c in cuts):
        extend_block_hashes(chain, tokens, block_size, ROOT, num_tokens=cut)
    extend_block_hashes(chain, tokens, block_size, ROOT)
    assert chain == hash_full_blocks(tokens, block_size, ROOT)
    assert len(chain) == len(tokens) // block_size


def test_extension_only_hashes_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:

    calls = count_hashes(monkeypatch)
    chain: list = []
    tokens = list(range(40))
    assert extend_block_hashes(chain, tokens[:16], 4, ROOT) == 4
    assert extend_block_hashes(chain, tokens[:18], 4, ROOT) == 0
    assert extend_block_hashes(chain, tokens[:20], 4, ROOT) == 1
    assert calls[0] == 5  # never rehashed from block 0


def test_a_chain_hashed_at_once_is_hash_block_block_by_block() -> None:
    """``hash_full_blocks`` encodes a whole prompt's tokens at once; its hashes are ``hash_block``'s, the
    spec, for any start, block size and int64 token (the largest included)."""
    gen = random.Random(3)
    for _ in range(100):
        bs, start = gen.choice([1, 3, 16, 32]), gen.randrange(4)
        tokens = [gen.choice([0, 1, 2**63 - 1, gen.randrange(300_000)]) for _ in range(gen.randrange(200))]
        want, parent = [], ROOT
        for b in range(start, len(tokens) // bs):
            parent = hash_block(parent, tokens[b * bs : (b + 1) * bs])
            want.append(parent)
        assert (
            hash_full_blocks(tokens, bs, ROOT, start)
            == want
            == hash_full_blocks(tuple(tokens), bs, ROOT, start)
        )


_CHILD = (
    "from kvtier.kv.hashing import root_hash, hash_full_blocks;"
    "r = root_hash(('fp-0123abcd', 'salt', 7, b'\\x00'));"
    "print(b''.join([r, *hash_full_blocks(list(range(100)), 16, r)]).hex())"
)


def test_hashes_are_identical_across_processes_and_hash_seeds() -> None:
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout.strip())
    root = root_hash(("fp-0123abcd", "salt", 7, b"\x00"))
    here = b"".join([root, *hash_full_blocks(list(range(100)), 16, root)]).hex()
    assert outputs == {here}


def test_known_answer_pins_the_encoding() -> None:
    """Changing the encoding would silently orphan blocks stored on disk: bump the domain tag instead."""
    import hashlib
    import struct

    expected_root = hashlib.sha256(b"kvtier-block-v1\x00root" + struct.pack("<Q", 0)).digest()
    assert root_hash(()) == expected_root
    expected = hashlib.sha256(
        b"kvtier-block-v1\x01block" + expected_root + struct.pack("<Q2q", 2, 1, 2)
    ).digest()
    assert hash_block(root_hash(()), [1, 2]) == expected


# ------------------------------------------------------------------------------ ChainMemo
def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``[n]``: the blocks hashed from now on (each one's hash starts from a copy of the block hasher)."""
    calls = [0]
    real = hashing._BLOCK_HASHER

    class Counted:
        def copy(self) -> object:
            calls[0] += 1
            return real.copy()

    monkeypatch.setattr(hashing, "_BLOCK_HASHER", Counted())
    return calls


def test_a_prompt_is_hashed_once_by_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Looked up on arrival, again at admission, then cached after its prefill: 50 blocks hashed once,
    plus the one block the prefill completed; the chains equal ``extend_block_hashes``'."""
    prompt = list(range(800))
    want = hash_full_blocks(prompt, 16, ROOT)
    calls = count_hashes(monkeypatch)
    memo = ChainMemo(16)
    first: list = []
    memo.extend(first, prompt, ROOT, 799)  # (len - 1) // 16 = 49 blocks: the lookup's
    second: list = []
    memo.extend(second, prompt, ROOT, 799)
    assert first == second == want[:49] and calls[0] == 49
    cached = first[:10]  # a sequence that adopted 10 blocks caches the rest after its prefill
    memo.extend(cached, prompt, ROOT, 800)
    assert cached == want and calls[0] == 50  # block 49 is new


def test_the_memo_keys_on_the_root_and_every_token(monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = list(range(160))
    salted, other = root_hash(("model-fingerprint-abc", "tenant")), prompt[:-1] + [7]
    cases = [(ROOT, prompt), (salted, prompt), (ROOT, other)]
    wants = [hash_full_blocks(tokens, 16, root) for root, tokens in cases]
    calls = count_hashes(monkeypatch)
    memo = ChainMemo(16)
    for (root, tokens), want in zip(cases, wants, strict=True):
        got: list = []
        memo.extend(got, tokens, root, 160)
        assert got == want
    assert calls[0] == 3 * 10  # nothing shared: another root, another last token


def test_a_decodes_new_block_is_hashed_directly_and_the_memo_stays_small() -> None:
    memo = ChainMemo(16, size=2)
    for i in range(5):
        memo.extend([], list(range(i, i + 160)), ROOT, 160)
    assert len(memo._chains) == 2
    grown = hash_full_blocks(list(range(48)), 16, ROOT)[:2]
    memo.extend(grown, list(range(48)), ROOT, 48)  # one new block: no tuple, no lookup, not stored
    assert grown == hash_full_blocks(list(range(48)), 16, ROOT) and len(memo._chains) == 2

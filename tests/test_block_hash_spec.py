"""docs/block-hashes.md is enough to compute kvtier's block hashes: its known-answer vectors are pinned
here, computed by kvtier's code, by an independent re-implementation written from the doc, and by the
reference code printed in the doc itself (extracted and run)."""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

import pytest

from kvtier.kv.hashing import HASH_SPEC_VERSION, group_key, hash_full_blocks, root_hash

DOC = Path(__file__).resolve().parent.parent / "docs" / "block-hashes.md"
FINGERPRINT = hashlib.sha256(b"kvtier test vector").hexdigest()
CACHE_IDENTITY = f"{FINGERPRINT}:float32"
BLOCK_SIZE = 4
TOKEN_IDS = [1, 2, 3, 4, 300, 70000, 49151, 0, 9, 10]
VECTORS = {  # cache_salt -> (root, h_0, h_1)
    "": (
        "59a47d39e1348a58750cc643a0a6ddaf4c0c52ff1c722971d3488eed8fdbaf9a",
        "bd9eb334dedc12034b9bd778c4ee378d3cd775e583813c00fadba812d4a44d82",
        "6af8ce02d41eb98a9fb9d64f560e112a3543d76610aa185fb0a3f5ae829e206c",
    ),
    "tenant-a": (
        "6b5674bb5b7365baaaf55f4806c842a553e72fdba187562ce7fde6a0927a1546",
        "fb9ee0bcb097390cb7754130dc657334ec703b5e5d10350382aa3f7b50e737b4",
        "574cb1ab5b7f262701db772ad94a5a45241b90c94f40c1849a47b828cb3d127f",
    ),
}

# Hybrid models: group 1's key of block 1 (cache_salt ""); group 0's keys are the chain itself.
GROUP_KEY_VECTOR = (1, 1, "616353ce847bac8fe86bbdd8c92e5eda84e0b1954376e0eb3a322dab4c1f927d")


def independent_chain(cache_identity: str, salt: str, token_ids: list[int], block_size: int) -> list[str]:
    """Written from the doc's prose (not its code): root, then one SHA-256 per full block."""
    domain = b"kvtier-block-v1"
    root = hashlib.sha256(domain + b"\x00root")
    root.update((2).to_bytes(8, "little"))
    for key in (cache_identity.encode(), salt.encode()):
        root.update(b"s" + len(key).to_bytes(8, "little") + key)
    parent = root.digest()
    chain = [parent.hex()]
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        body = block_size.to_bytes(8, "little") + b"".join(
            t.to_bytes(8, "little", signed=True) for t in block
        )
        parent = hashlib.sha256(domain + b"\x01block" + parent + body).digest()
        chain.append(parent.hex())
    return chain


def doc_reference_code() -> dict[str, object]:
    """Run the doc's reference implementation (its one ```python block)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1, "the doc should hold exactly one python block: the reference implementation"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)  # noqa: S102 - our own doc's code
    return namespace


@pytest.mark.parametrize("salt", sorted(VECTORS))
def test_kvtier_matches_the_known_answers(salt: str) -> None:
    root = root_hash((CACHE_IDENTITY, salt))
    hashes = hash_full_blocks(TOKEN_IDS, BLOCK_SIZE, root)
    assert [root.hex(), *(h.hex() for h in hashes)] == list(VECTORS[salt])


@pytest.mark.parametrize("salt", sorted(VECTORS))
def test_independent_implementation_matches_the_known_answers(salt: str) -> None:
    assert independent_chain(CACHE_IDENTITY, salt, TOKEN_IDS, BLOCK_SIZE) == list(VECTORS[salt])


@pytest.mark.parametrize("salt", sorted(VECTORS))
def test_the_docs_reference_code_matches_the_known_answers(salt: str) -> None:
    ns = doc_reference_code()
    root = ns["root"](CACHE_IDENTITY, salt)  # type: ignore[operator]
    hashes = ns["block_hashes"](TOKEN_IDS, BLOCK_SIZE, root)  # type: ignore[operator]
    assert [root.hex(), *(h.hex() for h in hashes)] == list(VECTORS[salt])


def test_the_doc_prints_the_pinned_vectors_and_version() -> None:
    text = DOC.read_text()
    assert FINGERPRINT in text and str(TOKEN_IDS) in text
    for chain in VECTORS.values():
        for value in chain:
            assert value in text
    assert f"spec version {HASH_SPEC_VERSION}" in text
    assert f'b"kvtier-block-v{HASH_SPEC_VERSION}"' in text


def test_independent_implementation_agrees_on_other_inputs() -> None:
    """Beyond the vectors: longer prompts, big token ids, another block size, a non-ASCII salt."""
    tokens = [(i * 7919) % 200_003 for i in range(67)]
    for block_size, salt in ((16, ""), (8, "tenant-ü"), (1, "x")):
        root = root_hash((CACHE_IDENTITY, salt))
        ours = [root.hex(), *(h.hex() for h in hash_full_blocks(tokens, block_size, root))]
        assert ours == independent_chain(CACHE_IDENTITY, salt, tokens, block_size)
        assert len(ours) == 1 + len(tokens) // block_size


def test_struct_and_int_to_bytes_encodings_agree() -> None:
    """The doc's struct format and the to_bytes form above are the same bytes (negative ids too)."""
    block = [0, 1, -1, 2**40]
    packed = struct.pack(f"<Q{len(block)}q", len(block), *block)
    manual = len(block).to_bytes(8, "little") + b"".join(t.to_bytes(8, "little", signed=True) for t in block)
    assert packed == manual


def test_group_keys_match_the_known_answer_three_ways() -> None:
    """kvtier's code, a re-implementation from the doc's prose, and the doc's reference code agree on
    the group-key vector; group 0 keeps the chain's own hashes (dense keys never change)."""
    group, block, expected = GROUP_KEY_VECTOR
    chain = hash_full_blocks(TOKEN_IDS, BLOCK_SIZE, root_hash((CACHE_IDENTITY, "")))
    assert group_key(chain[block], group).hex() == expected
    assert [group_key(h, 0) for h in chain] == chain
    prose = hashlib.sha256(b"kvtier-block-v1" + b"\x02group" + chain[block] + group.to_bytes(8, "little"))
    assert prose.hexdigest() == expected
    ns = doc_reference_code()
    assert ns["group_key"](chain[block], group).hex() == expected  # type: ignore[operator]
    assert expected in DOC.read_text()

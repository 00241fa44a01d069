"""SHA-256 and HMAC-SHA256 written for peer authentication
(fabric/backends/hmac_sha256.h): FIPS 180-4's examples, RFC 4231's HMAC test
cases, and Python's hashlib/hmac on random inputs, every length around the
64-byte block and its padding boundary (55/56 bytes) included."""
import hashlib
import hmac

import pytest
from hypothesis import given, settings, strategies as st

auth = pytest.importorskip("fabric.backends.auth", reason="fabric.backends.auth is not built")


def test_fips_180_4_examples():
    assert auth._sha256(b"abc").hex() == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert auth._sha256(b"").hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert auth._sha256(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq").hex() == \
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
    assert auth._sha256(b"a" * 1_000_000).hex() == \
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"


# RFC 4231, section 4: (key, data, HMAC-SHA-256); case 5 is truncated to 128 bits
RFC4231 = [
    (b"\x0b" * 20, b"Hi There",
     "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?",
     "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50,
     "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (bytes(range(1, 26)), b"\xcd" * 50,
     "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than block-size data. "
                    b"The key needs to be hashed before being used by the HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]


@pytest.mark.parametrize("key, data, expected", RFC4231)
def test_rfc_4231_hmac_cases(key, data, expected):
    assert auth._hmac_sha256(key, data).hex() == expected


def test_rfc_4231_truncated_case():
    key, data = b"\x0c" * 20, b"Test With Truncation"
    assert auth._hmac_sha256(key, data)[:16].hex() == "a3b6167473100ee06e0c796c2955552b"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_sha256_matches_hashlib(data):
    assert auth._sha256(data) == hashlib.sha256(data).digest()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.lists(st.binary(max_size=150), max_size=4))
def test_hmac_matches_python_over_any_split_of_the_message(key, parts):
    assert auth._hmac_sha256(key, *parts) == hmac.new(key, b"".join(parts), "sha256").digest()


@pytest.mark.parametrize("n", [0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129])
def test_every_length_around_the_block_and_padding_boundaries(n):
    data = bytes(range(256)) * 2
    assert auth._sha256(data[:n]) == hashlib.sha256(data[:n]).digest()
    assert auth._hmac_sha256(data[:n], data[:n]) == hmac.new(data[:n], data[:n], "sha256").digest()


def test_constant_time_comparison():
    assert auth._equal(b"", b"")
    assert auth._equal(b"x" * 32, b"x" * 32)
    assert not auth._equal(b"x" * 32, b"x" * 31 + b"y")
    assert not auth._equal(b"\x00" + b"x" * 31, b"\x80" + b"x" * 31)
    with pytest.raises(ValueError):
        auth._equal(b"a", b"ab")

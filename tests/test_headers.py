"""Header values: any client string survives the trip into metadata and back, and no value fails a call."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from splitstream.common.headers import from_header_value, header_value

PRINTABLE_ASCII = st.text(alphabet=[chr(code) for code in range(0x20, 0x7F)])


@given(st.text())
def test_any_string_is_a_printable_ascii_header_value_that_decodes_to_itself(text: str) -> None:
    value = header_value(text)
    assert value.isascii()
    assert value.isprintable()
    assert from_header_value(value) == text


@given(PRINTABLE_ASCII | st.lists(st.sampled_from(["%", "%80", "%c3", "%C3%BC", "%zz", "a"])).map("".join))
def test_any_value_a_client_can_send_decodes_without_an_error(value: str) -> None:
    """A value header_value cannot have made (``%80``) raised UnicodeDecodeError, failing the call."""
    decoded = from_header_value(value)
    assert from_header_value(header_value(decoded)) == decoded  # and echoing it back in a trailer is safe

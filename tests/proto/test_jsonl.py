"""One JSON Lines record: every way `json.loads` can fail is `path:line` in one line."""

from __future__ import annotations

import pytest
from redraft.proto.errors import RedraftError
from redraft.proto.jsonl import parse_record


@pytest.mark.parametrize("line, message", [
    ("[" * 100_000, "f.jsonl:3: JSON nested too deeply"),
    ('{"a": ' * 100_000, "f.jsonl:3: JSON nested too deeply"),
    ("{not json}", "f.jsonl:3: invalid JSON (Expecting property name"),
    ("1" * 5000, "f.jsonl:3: invalid JSON (Exceeds the limit"),  # no .msg: a plain ValueError
])
def test_bad_records_name_their_line(line, message):
    with pytest.raises(RedraftError) as err:
        parse_record(line, "f.jsonl:3", RedraftError)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_good_record_is_its_value():
    assert parse_record('{"prompt": "hi", "n": [1, 2]}', "f.jsonl:1", RedraftError) == {
        "prompt": "hi", "n": [1, 2]}

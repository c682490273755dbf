"""One JSON Lines record, parsed with errors a user can act on.

Why one place: every command that reads .jsonl (`index`, `generate --prompts`, `bench
--questions`, `train-medusa --data`) must report a bad line as `path:line` in one line,
including the two failures `json.loads` does not raise as a decode error: nesting too deep
for the parser (RecursionError) and an integer too long to convert (a plain ValueError).
"""

from __future__ import annotations

import json


def parse_record(line: str, where: str, error: type[Exception]) -> object:
    """The JSON value of one line; `error("<where>: ...")` if it is not one."""
    try:
        return json.loads(line)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:
        raise error(f"{where}: invalid JSON ({getattr(exc, 'msg', exc)})") from None

"""`--config FILE` and `--print-config` for a subcommand: its flags read from a TOML file.

Why here and not in each command: every flag of the command is a key of the same name
(`max-sessions` or `max_sessions`), with one precedence (command line over file over
defaults) and one way to refuse a file (one line naming the key, exit 2), as `vllm serve
--config` does. The file's values become the parser's defaults before the command line is
parsed, so argparse itself gives the command line the last word, and a required flag the
file supplies is no longer required.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from typing import Any, NoReturn

try:
    import tomllib
except ImportError:  # Python 3.10: --config says it needs 3.11
    tomllib = None  # type: ignore[assignment]

# Flags that are about the configuration itself, never keys of it.
_OWN = ("config", "print_config", "help")


def add_config_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Give `parser` `--config FILE` and `--print-config`, and read the file before the
    rest of the command line (the parser's own parse is wrapped: argparse offers no hook
    between a subcommand's defaults and its arguments)."""
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file whose keys are this command's flags (max-sessions = "
                        "128); the command line overrides it")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective configuration as TOML and exit")
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        arg_list = list(sys.argv[1:] if args is None else args)
        path = _config_path(arg_list)
        if path is not None:
            values = load_config(parser, path, command)
            for action in parser._actions:
                if action.dest in values:
                    action.required = False
            parser.set_defaults(**values)
        return original(arg_list, namespace)

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _config_path(args: list[str]) -> str | None:
    """The last `--config FILE` (or `--config=FILE`) of the command line."""
    path = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    return path


def _fail(command: str, message: str) -> NoReturn:
    print(f"redraft {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags a file may set, by their dest (and a positional list, as `inputs`)."""
    return {a.dest: a for a in parser._actions
            if (a.option_strings or a.nargs == "*") and a.dest not in _OWN
            and a.dest is not argparse.SUPPRESS}


def load_config(parser: argparse.ArgumentParser, path: str, command: str) -> dict[str, Any]:
    """The file's values by dest, each checked and converted as its flag would be; a
    problem is one line naming the file and the key, and exit 2."""
    if tomllib is None:
        _fail(command, f"--config {path}: reading TOML needs Python 3.11 or later")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        _fail(command, f"--config {path}: {exc.strerror or exc}")
    except tomllib.TOMLDecodeError as exc:
        _fail(command, f"--config {path}: not TOML ({exc})")
    options = _options(parser)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        dest = key.replace("-", "_")
        action = options.get(dest)
        if action is None:
            near = difflib.get_close_matches(dest, options, 1)
            hint = f"; did you mean {near[0].replace('_', '-')!r}?" if near else ""
            _fail(command, f"--config {path}: unknown key {key!r} (not a flag of `redraft "
                  f"{command}`{hint})")
        values[dest] = _convert(action, key, value, path, command)
    return values


def _convert(action: argparse.Action, key: str, value: Any, path: str, command: str) -> Any:
    where = f"--config {path}: {key}"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            _fail(command, f"{where} must be true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if action.nargs == "?" and action.const is not None and isinstance(value, bool):
        return action.const if value else None
    if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_scalar(action, where, v, command) for v in items]
    return _scalar(action, where, value, command)


def _scalar(action: argparse.Action, where: str, value: Any, command: str) -> Any:
    kind = action.type
    if isinstance(value, (dict, list)) or isinstance(value, bool):
        _fail(command, f"{where}: {value!r} is not a single value of this flag")
    if kind is int and not isinstance(value, int):
        _fail(command, f"{where} must be an integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        _fail(command, f"{where} must be a number, got {value!r}")
    if kind is None and not isinstance(value, str):
        _fail(command, f"{where} must be a string, got {value!r}")
    if callable(kind) and kind not in (int, float):
        try:
            value = kind(value if isinstance(value, str) else str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            _fail(command, f"{where}: {exc}")
    elif kind is float:
        value = float(value)
    if action.choices is not None and value not in action.choices:
        _fail(command, f"{where} must be one of {', '.join(map(str, action.choices))}, got "
              f"{value!r}")
    return value


def config_toml(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The effective configuration as TOML: every flag's value (command line, file or
    default), unset ones as comments, in the order of `--help`."""
    lines = []
    for dest, action in _options(parser).items():
        key = action.option_strings[-1].lstrip("-") if action.option_strings else dest
        value = getattr(args, dest, None)
        if isinstance(action, argparse._StoreFalseAction):
            key, value = dest.replace("_", "-"), not value
        if value is None:
            lines.append(f"# {key} = (unset)")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value)
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped)
    return f'"{escaped}"'


def print_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--print-config`: the effective configuration on stdout."""
    sys.stdout.write(config_toml(parser, args))

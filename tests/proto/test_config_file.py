"""`--config FILE` and `--print-config`: the command line over the file over the defaults,
a bad file refused in one line with exit 2, and the shipped sample loading as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from redraft.datastore.service.serve_cli import config_from_args

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str):
    from redraft.decoder.cli.main import build_parser
    argv = list(argv)
    return build_parser(argv).parse_args(argv)


def redraft(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "redraft.decoder.cli", *argv],
                          capture_output=True, text=True, timeout=60)


def test_command_line_over_file_over_defaults(tmp_path):
    f = tmp_path / "serve.toml"
    f.write_text('datastore = "ds"\nmax-sessions = 7\nmax_budget = 512\nno-verify = true\n'
                 'learn = "global"\n')
    args = parse("serve", "--config", str(f), "--max-sessions", "9")
    config = config_from_args(args)
    assert args.datastore == "ds"  # --datastore is not needed on the command line
    assert config.max_sessions == 9  # the command line wins
    assert config.max_budget == 512 and config.learn == "global"  # the file over defaults
    assert config.verify_checksums is False
    assert config.max_depth == 128  # neither: the default


@pytest.mark.parametrize("text, says", [
    ("max-sesions = 3\n", "unknown key 'max-sesions' (not a flag of `redraft serve`; did "
     "you mean 'max-sessions'?)"),
    ('max-sessions = "3"\n', "max-sessions must be an integer, got '3'"),
    ('learn = "maybe"\n', "learn must be one of tenant, global, off, got 'maybe'"),
    ("no-verify = 1\n", "no-verify must be true or false, got 1"),
    ("port = [1]\n", "port: [1] is not a single value of this flag"),
    ("max-sessions = \n", "not TOML"),
])
def test_a_bad_file_is_one_line_naming_the_key_and_exit_2(tmp_path, text, says):
    f = tmp_path / "serve.toml"
    f.write_text(text)
    out = redraft("serve", "--datastore", "ds", "--config", str(f))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"redraft serve: error: --config {f}: ") and says in out.stderr


def test_a_bad_value_the_file_gives_is_refused_as_the_flags_would_be(tmp_path):
    f = tmp_path / "serve.toml"
    f.write_text("max-sessions = 0\n")
    out = redraft("serve", "--datastore", "ds", "--config", str(f))
    assert out.returncode == 2
    assert out.stderr == ("redraft serve: error: --max-sessions must be positive and at most "
                          "4294967295, got 0\n")


def test_print_config_prints_the_effective_configuration_as_toml_that_loads_back(tmp_path):
    f = tmp_path / "serve.toml"
    f.write_text('datastore = "d s"\nworkers = 2\nport = 6000\n')
    out = redraft("serve", "--config", str(f), "--port", "6001", "--print-config")
    assert out.returncode == 0, out.stderr
    printed = tomllib.loads(out.stdout)
    assert printed["datastore"] == "d s" and printed["port"] == 6001
    assert printed["workers"] == 2 and printed["batch-threads"] >= 1  # resolved, not "auto"
    again = tmp_path / "again.toml"
    again.write_text(out.stdout)
    assert redraft("serve", "--config", str(again), "--print-config").stdout == out.stdout


def test_index_takes_a_config_file_too(tmp_path):
    f = tmp_path / "index.toml"
    f.write_text('inputs = ["a", "b"]\ncorpus = "code"\nexclude = "*.md"\nray = true\n')
    args = parse("index", "--config", str(f), "--corpus", "docs")
    assert args.inputs == ["a", "b"] and args.corpus == "docs" and args.exclude == ["*.md"]
    assert args.ray is True


def test_the_sample_config_file_loads():
    sample = ROOT / "docs" / "serve.example.toml"
    args = parse("serve", "--config", str(sample))
    config = config_from_args(args)
    want = tomllib.loads(sample.read_text())
    assert args.datastore == want["datastore"] and args.port == want["port"]
    assert config.max_sessions == want["max-sessions"] and config.learn == want["learn"]

"""`redraft serve`'s arguments into its config: the defaults that depend on the machine."""

from __future__ import annotations

import argparse
import os

from redraft.datastore.service.config import MAX_AUTO_BATCH_THREADS
from redraft.datastore.service.serve_cli import config_from_args, register


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", "--datastore", "ds", *argv])


def test_batch_threads_default_shares_this_processs_cores_among_its_workers():
    cores = len(os.sched_getaffinity(0))
    for workers in (1, 2, 3, 1024):
        config = config_from_args(parse("--port", "5000", "--workers", str(workers)))
        assert config.batch_threads == max(1, min(MAX_AUTO_BATCH_THREADS, cores // workers))
    assert config_from_args(parse("--batch-threads", "3")).batch_threads == 3

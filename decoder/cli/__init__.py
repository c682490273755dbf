"""The `redraft` command (`main`) and the decoder's subcommands: `generate_cli`, `bench_cli`,
`train_medusa_cli`. The datastore's subcommands come from `redraft.datastore.cli`."""

from redraft.decoder.cli.main import main

__all__ = ["main"]

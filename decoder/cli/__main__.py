"""`python -m redraft.decoder.cli`: the `redraft` command.

Tested by: tests/datastore/cli/test_datastore_cli.py"""

import sys

from redraft.decoder.cli.main import main

sys.exit(main())

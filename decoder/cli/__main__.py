"""`python -m redraft.decoder.cli`: the `redraft` command."""

import sys

from redraft.decoder.cli.main import main

sys.exit(main())

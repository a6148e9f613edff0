"""`python -m tokensvc` is the `tokensvc` command."""

import sys

from tokensvc.cli.main import main

sys.exit(main())

"""`python -m zaya_cli ...`: the `zaya` command without its console script."""

import sys

from zaya_cli.main import main

sys.exit(main())

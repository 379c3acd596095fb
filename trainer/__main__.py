"""`python -m trainer ...` == `dflash-train ...` (dflash-ops runs it this way from a release dir)."""

import sys

from trainer.cli.main import main

sys.exit(main())

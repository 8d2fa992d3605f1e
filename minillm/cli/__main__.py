"""`python -m minillm.cli ...` is the same as the `minillm` command."""

import sys

from minillm.cli import main

sys.exit(main())

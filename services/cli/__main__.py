"""`python -m epdserve.services.cli ...`: the `epdserve` command (how `epdserve up` starts its children)."""
import sys

from epdserve.services.cli.main import main

sys.exit(main())

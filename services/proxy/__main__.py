"""`python -m epdserve.services.proxy [options]`: the same as `epdserve serve proxy [options]`."""
import sys

from epdserve.services.cli.main import main

sys.exit(main(["serve", "proxy", *sys.argv[1:]]))

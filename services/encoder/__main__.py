"""`python -m epdserve.services.encoder [options]`: the same as `epdserve serve encoder [options]`."""
import sys

from epdserve.services.cli import main

sys.exit(main(["serve", "encoder", *sys.argv[1:]]))

"""`python -m epdserve.services.encoder [options]`: the same as `epdserve serve encoder [options]`."""
import sys

from epdserve.services.cli.main import main

sys.exit(main(["serve", "encoder", *sys.argv[1:]]))

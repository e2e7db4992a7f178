"""`python -m epdserve.services.unified [options]`: the same as `epdserve serve unified [options]`."""
import sys

from epdserve.services.cli.main import main

sys.exit(main(["serve", "unified", *sys.argv[1:]]))

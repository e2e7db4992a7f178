"""`python -m epdserve.services.decode [options]`: the same as `epdserve serve decode [options]`."""
import sys

from epdserve.services.cli.main import main

sys.exit(main(["serve", "decode", *sys.argv[1:]]))

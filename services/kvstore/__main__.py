"""`python -m epdserve.services.kvstore [options]`: the same as `epdserve serve kvstore [options]`."""
import sys

from epdserve.services.cli.main import main

sys.exit(main(["serve", "kvstore", *sys.argv[1:]]))

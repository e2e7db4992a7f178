"""`python -m epdserve.services.prefill [options]`: the same as `epdserve serve prefill [options]`."""
import sys

from epdserve.services.cli.main import main

sys.exit(main(["serve", "prefill", *sys.argv[1:]]))

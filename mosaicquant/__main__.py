import sys

from mosaicquant.harness.cli import main

sys.exit(main())
